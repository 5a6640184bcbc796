"""`megarl bench` / run_all.py: sections run in their own processes, failures are recorded, the JSON
and the markdown report have the documented structure. No timing is asserted."""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys

import pytest

from megarl.bench import add_arguments

pytestmark = pytest.mark.unit


def _fabricated_bench() -> dict:
    """A bench.json as run_all writes it, with made-up numbers for every section layout."""
    load = [1.5, 2.0, 2.5]
    summary = {"step_s_mean": 2.0, "generated_tokens_per_s": 100.0, "training_tokens_per_s": 300.0,
               "reward_first": 0.1, "reward_last_window_mean": 0.4, "reward_window": 5}
    e2e = {
        "setup": {"steps": 40, "precision": "fp32"},
        "megarl": {"summary": summary, "memory": {"workload_mib": 3000.0, "tree_mib": 3500.0}, "wall_s": 120.0,
                   "load_average_before": load},
        "trl": {"summary": {**summary, "step_s_mean": 0.5, "generated_tokens_per_s": 400.0,
                            "training_tokens_per_s": 1200.0, "reward_last_window_mean": 0.5},
                "memory": {"workload_mib": 1000.0, "tree_mib": 1000.0}, "wall_s": 30.0, "load_average_before": load},
        "ratios_megarl_over_trl": {"step_time": 4.0, "generated_tokens_per_s": 0.25, "training_tokens_per_s": 0.25,
                                   "peak_memory_workload": 3.0, "reward_last_window": 0.8},
    }
    e2e["megarl"]["records"] = [{"step": i + 1, "score_mean": i / 100} for i in range(16)]
    e2e["trl"]["records"] = [{"step": i + 1, "score_mean": 0.5} for i in range(16)]
    e2e["trl"]["torch_threads"] = 2
    e2e["trl_variants"] = {"threads=1": {**e2e["trl"], "torch_threads": 1, "summary": {**e2e["trl"]["summary"],
                                                                                        "step_s_mean": 1.0}}}
    e2e["ratios_megarl_over_trl_variants"] = {"threads=1": {**e2e["ratios_megarl_over_trl"], "step_time": 2.0}}
    phases = {"runs": {"grpo": {"step_s_mean": 2.0, "timed_steps": 9, "biggest_phase": "gen",
                                "phase_seconds_mean": {"gen": 1.0, "update_actor": 0.6, "other": 0.4},
                                "phase_shares": {"gen": 0.5, "update_actor": 0.3, "other": 0.2},
                                "load_average_before": load}},
              "errors": {"ppo": "megarl train exit code 1\nValueError: critic"}}
    scaling = {"runs": [{"name": "workers=2 (base)", "workers": 2, "layers": 4, "parameters": 2_370_000,
                         "step_s_mean": 2.0, "step_time_over_base": 1.0, "generated_tokens_per_s": 100.0,
                         "training_tokens_per_s": 300.0, "peak_memory_workload_mib": 3000.0,
                         "load_average_before": load}], "errors": {}}
    components = {"components": {
        "algorithms": {"status": "ok", "seconds": 3.0, "load_average_before": load, "result": {"results": [
            {"estimator": "grpo", "vectorised_tokens_per_s": 5e7, "speedup": 17.0}]}},
        "convert": {"status": "missing", "error": "benchmarks/convert.py does not exist"},
        "memory_phases": {"status": "ok", "seconds": 90.0, "load_average_before": load, "result": {"summary": {
            "parameters": 25_000_000, "update_peak_drop_gb": 0.15, "drop_over_weight_copy": 1.6,
            "rollout_weight_copy_gb": 0.094, "step_time_sleep_over_resident": 0.9,
            "step_time_offload_over_resident": 1.5}}},
    }}

    def ok(result: dict) -> dict:
        return {"status": "ok", "seconds": 10.0, "load_average_before": load, "load_average_after": load,
                "finished_utc": "2026-01-01T00:00:00Z", "result": result}

    return {"schema_version": 1, "generated_utc": "2026-01-01T00:00:00Z", "quick": False,
            "machine": {"cpu_count": 2, "platform": "Linux", "torch": "2.13.0", "cuda": None},
            "sections": {"e2e": ok(e2e), "phases": ok(phases), "scaling": ok(scaling), "components": ok(components),
                         "gpu": ok({"skipped": "no CUDA device on this machine"})}}


def _tables(markdown: str) -> list[list[list[str]]]:
    """Every markdown table as rows of cells (separator rows dropped)."""
    tables, current = [], []
    for line in markdown.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(set(c) <= {"-"} for c in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def test_report_of_a_fabricated_result_has_every_section_and_even_tables():
    from report import render_report

    bench = _fabricated_bench()
    bench["sections"]["e2e"]["result"]["machine"] = {"cpu": "Intel(R) Xeon(R) Processor (AVX2, AVX-512, AMX)"}
    bench["sections"]["gpu"]["result"]["machine"] = {"cpu": "AMD EPYC (AVX2)", "cuda": "NVIDIA H200"}
    md = render_report(bench)
    for heading in ("End to end", "Phase breakdown", "Scaling", "Component benchmarks", "GPU"):
        assert re.search(rf"^## {heading}", md, re.M), heading
    tables = _tables(md)
    assert tables, md
    for t in tables:  # every row as wide as its header
        assert {len(row) for row in t} == {len(t[0])}, t
    where = {row[0]: row[-1] for row in tables[0][1:]}  # each section's machine: GPU, else CPU, else "-"
    assert where == {"e2e": "Intel(R) Xeon(R) Processor (AVX2, AVX-512, AMX)", "phases": "-", "scaling": "-",
                     "components": "-", "gpu": "NVIDIA H200"}, where
    e2e = next(t for t in tables if t[0][:4] == ["", "megarl", "TRL (2 threads)", "megarl / TRL"])
    assert e2e[0][4:] == ["TRL (threads=1)", "megarl / TRL (threads=1)"]
    step_row = next(r for r in e2e if r[0].startswith("step time"))
    assert step_row[1:] == ["2", "0.5", "4", "1", "2"]
    memory_row = next(r for r in e2e if r[0].startswith("peak memory, workload"))
    assert memory_row[1:] == ["3,000", "1,000", "3", "1,000", "3"]
    curve = next(t for t in tables if t[0][0] == "steps")
    assert curve[0][1:3] == ["1-2", "3-4"] and len(curve[0]) == 9  # 16 steps in 8 blocks
    assert curve[1][:3] == ["megarl", "0.005", "0.025"] and curve[2][1] == "0.5"
    phases = next(t for t in tables if t[0] == ["phase", "mean s", "share of step"])
    assert phases[1] == ["**gen**", "1", "50.0%"]  # biggest phase first, marked
    components = next(t for t in tables if t[0][0] == "component")
    assert [r[:2] for r in components[1:]] == [["algorithms", "ok"], ["convert", "missing"], ["memory_phases", "ok"]]
    assert [r[4] for r in components[1:]] == ["-", "-", "-"]  # written before components carried a time
    assert "17x the plain loop" in components[1][5]
    assert components[3][5] == ("25,000,000 params: update-phase peak RSS drops 0.15 GiB when the rollout sleeps "
                                "(1.6x its 0.094 GiB weight copy); step time sleep/resident 0.9, offload/resident 1.5")
    assert "ppo: failed" in md and "Skipped: no CUDA device" in md


def test_report_gives_the_25m_mfu_against_the_best_of_the_measured_rates():
    from report import render_report

    bench = _fabricated_bench()
    e2e_25m = copy.deepcopy(bench["sections"]["e2e"])
    e2e_25m["result"]["mfu"] = {"useful_params": 25_000_000, "mfu_precision": "fp32",
                                "matmul_fp32_flops_per_s": 300e9,
                                "matmul_fp32_flops_per_s_measured": [250e9, 300e9, 280e9],
                                "megarl_update_mfu": 0.55, "megarl_old_log_prob_mfu": None, "trl_training_mfu": 0.45}
    e2e_25m["result"]["megarl"]["summary"]["phase_seconds_mean"] = {"gen": 3.0, "update_actor": 4.0}
    bench["sections"]["e2e_25m"] = e2e_25m
    md = render_report(bench)
    assert ("Useful-token MFU against torch.mm fp32 at 300 GFLOP/s (2 threads, the best of 250, 300, 280 measured "
            "before, between and after round 1's two runs), 25,000,000 parameters") in md
    mfu = next(t for t in _tables(md) if t[0] == ["phase", "MFU"])
    assert mfu[1:] == [["megarl update (6 x params x tokens it ran)", "0.55"],
                       ["megarl old log-prob pass (2 x params x tokens)", "-"],
                       ["TRL training (step minus generation and scoring; 6 x params x tokens)", "0.45"]]
    # A record written before the rate was measured more than once still renders.
    del e2e_25m["result"]["mfu"]["matmul_fp32_flops_per_s_measured"]
    assert "(2 threads, measured in the same run)" in render_report(bench)


def test_failed_section_is_recorded_and_the_others_still_run(tmp_path):
    from run_all import run_all

    bench = run_all(
        ["e2e", "components"], tmp_path, quick=True,
        section_args={"e2e": ["--bench-python", str(tmp_path / "no-such-python")],
                      "components": ["--components", "algorithms"]},
    )
    written = json.loads((tmp_path / "bench.json").read_text())
    assert written["sections"].keys() == bench["sections"].keys() == {"e2e", "components"}
    e2e = written["sections"]["e2e"]
    assert e2e["status"] == "failed"
    assert "make_bench_env.sh" in e2e["error"]
    comp = written["sections"]["components"]
    assert comp["status"] == "ok", comp.get("error")
    algorithms = comp["result"]["components"]["algorithms"]
    assert algorithms["status"] == "ok", algorithms.get("error")
    assert {r["estimator"] for r in algorithms["result"]["results"]} == {"grpo", "rloo", "gae"}
    for entry in written["sections"].values():
        assert entry["quick"] is True
        assert len(entry["load_average_before"]) == 3 and entry["seconds"] >= 0
    report = (tmp_path / "REPORT.md").read_text()
    assert "| e2e | failed |" in report and "| components | ok |" in report

    # A later run of one section keeps the other's entry (incremental measurements) ...
    failing_e2e = {"e2e": ["--bench-python", str(tmp_path / "no-such-python")]}
    run_all(["e2e"], tmp_path, quick=True, section_args=failing_e2e)
    again = json.loads((tmp_path / "bench.json").read_text())["sections"]
    assert list(again) == ["e2e", "components"] and again["components"] == comp
    # ... unless asked to start over.
    run_all(["e2e"], tmp_path, quick=True, fresh=True, section_args=failing_e2e)
    assert set(json.loads((tmp_path / "bench.json").read_text())["sections"]) == {"e2e"}


def test_a_run_of_some_components_keeps_the_earlier_runs_others(tmp_path):
    from run_all import run_all

    earlier = {"status": "ok", "started_utc": "2026-01-01T00:00:00Z", "seconds": 99.0, "result": {"components": {
        "convert": {"status": "ok", "seconds": 5.0, "result": {"made_up": 1}},
        "algorithms": {"status": "timeout", "seconds": 900.0, "error": "no result within 900 s"},
        "attention": {"status": "ok", "seconds": 7.0, "measured_utc": "2026-01-02T00:00:00Z", "result": {}}}}}
    (tmp_path / "bench.json").write_text(json.dumps({"schema_version": 1, "sections": {"components": earlier}}))
    run_all(["components"], tmp_path, quick=True, section_args={"components": ["--components", "algorithms"]})
    section = json.loads((tmp_path / "bench.json").read_text())["sections"]["components"]
    entries = section["result"]["components"]
    assert list(entries) == ["algorithms", "convert", "attention"]  # components.py's order
    assert entries["algorithms"]["status"] == "ok", entries["algorithms"].get("error")
    assert entries["algorithms"]["measured_utc"] > "2026-01-02"
    assert entries["convert"] == {**earlier["result"]["components"]["convert"], "measured_utc": "2026-01-01T00:00:00Z"}
    assert entries["attention"]["measured_utc"] == "2026-01-02T00:00:00Z"  # its own time, not its run's
    assert section["components_kept"] == ["convert", "attention"]
    report = (tmp_path / "REPORT.md").read_text()
    assert re.search(r"\| convert \| ok \| 5 \| - \| 2026-01-01T00:00:00Z \|", report)
    assert "| algorithms | ok |" in report

    # A run that wrote nothing replaces nothing of the section's result either.
    from run_all import merge_components

    failed = {"status": "timeout", "error": "no result within 1 s"}
    assert merge_components(section, failed) == failed
    assert merge_components(None, section) == section
    from components import COMPONENTS

    retired = {**section, "result": {"components": {**entries, "retired_benchmark": {"status": "ok"}}}}
    every = {**section, "result": {"components": {name: {"status": "ok"} for name in COMPONENTS}}}
    assert merge_components(retired, every) == every  # a full run keeps nothing, not even a retired name
    assert "retired_benchmark" in merge_components(retired, section)["result"]["components"]


def test_cli_rejects_unknown_components_and_components_without_their_section(capsys):
    from megarl.cli import main

    assert main(["bench", "--sections", "components", "--components", "algorithms,nonsense"]) == 2
    assert "nonsense" in capsys.readouterr().err
    assert main(["bench", "--sections", "e2e", "--components", "algorithms"]) == 2
    assert "needs the components section" in capsys.readouterr().err


def test_cli_rejects_unknown_sections(capsys):
    from megarl.cli import main

    assert main(["bench", "--sections", "e2e,nonsense"]) == 2
    assert "nonsense" in capsys.readouterr().err


def test_report_shows_every_round_with_median_and_range():
    from report import render_report

    bench = _fabricated_bench()
    per_round = [{"megarl_step_s": 0.2, "trl_step_s": 0.25, "step_time": 0.8, "wall_step_time": 0.85,
                  "generated_tokens_per_s": 1.25, "reward_ratio_at_equal_time": 1.1},
                 {"megarl_step_s": 0.3, "trl_step_s": 0.2, "step_time": 1.5, "wall_step_time": 1.45,
                  "generated_tokens_per_s": 0.667, "reward_ratio_at_equal_time": None},
                 {"megarl_step_s": 0.22, "trl_step_s": 0.2, "step_time": 1.1, "wall_step_time": None,
                  "generated_tokens_per_s": 0.909, "reward_ratio_at_equal_time": 0.9}]
    bench["sections"]["e2e"]["result"]["rounds"] = {
        "per_round": per_round, "order": "megarl then TRL",
        "summary": {"rounds": 3, "step_time": {"median": 1.1, "min": 0.8, "max": 1.5},
                    "wall_step_time": {"median": 1.15, "min": 0.85, "max": 1.45},
                    "generated_tokens_per_s": {"median": 0.909, "min": 0.667, "max": 1.25},
                    "reward_ratio_at_equal_time": {"median": 1.0, "min": 0.9, "max": 1.1}}}
    md = render_report(bench)
    assert "The pair ran 3 times in turn (megarl then TRL)" in md
    rounds = next(t for t in _tables(md) if t[0][1:4] == ["round 1", "round 2", "round 3"])
    assert {len(row) for row in rounds} == {6}
    assert rounds[1] == ["megarl step (s)", "0.2", "0.3", "0.22", "", ""]
    assert rounds[3] == ["step time, megarl / TRL", "0.8", "1.5", "1.1", "1.1", "0.8-1.5"]
    assert rounds[4] == ["wall clock per step, megarl / TRL", "0.85", "1.45", "-", "1.15", "0.85-1.45"]
    assert rounds[6] == ["reward over the common time span, megarl / TRL", "1.1", "-", "0.9", "1", "0.9-1.1"]
    bench["sections"]["e2e"]["result"]["rounds"] = {"per_round": per_round[:1], "summary": {"rounds": 1}}
    assert "times in turn" not in render_report(bench)  # one round: the main table says it all


def test_bench_command_passes_the_rounds_to_the_e2e_section(tmp_path, monkeypatch):
    import run_all

    seen = {}
    monkeypatch.setattr(run_all, "run_all", lambda sections, out_dir, quick, fresh, timeout, section_args: seen.update(
        quick=quick, args=section_args) or {"sections": {name: {"status": "ok"} for name in sections}})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run_all.main_from_args(parser.parse_args(["--sections", "e2e", "--out-dir", str(tmp_path)])) == 0
    plot = str(tmp_path / "e2e_quickstart_reward_vs_time.png")  # the name REPORT.md gives
    assert seen["args"]["e2e"] == ["--rounds", "3", "--plot", plot]
    run_all.main_from_args(parser.parse_args(["--sections", "e2e", "--quick", "--e2e-steps", "5", "--out-dir",
                                              str(tmp_path)]))
    assert seen["args"]["e2e"] == ["--rounds", "1", "--plot", plot, "--steps", "5"]
    assert seen["args"]["e2e_25m"] == ["--plot", str(tmp_path / "e2e_25m_reward_vs_time.png")]
    assert run_all.main_from_args(parser.parse_args(["--sections", "e2e", "--e2e-rounds", "0"])) == 2


def test_cpu_description_names_the_model_and_the_matmul_features():
    from common import cpu_description

    block = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\n"
             "flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 amx_tile amx_bf16 amx_int8\n\n"
             "processor\t: 1\nmodel name\t: other\nflags\t\t: avx2\n")
    assert cpu_description(block) == "Intel(R) Xeon(R) Processor (AVX2, AVX-512, AVX-512 BF16, AMX)"
    assert cpu_description("model name\t: AMD EPYC 7B13\nflags\t\t: sse2 avx avx2 fma\n") == "AMD EPYC 7B13 (AVX2)"
    assert cpu_description("model name\t: Old CPU\nflags\t\t: sse2\n") == "Old CPU"


def _quick_component_run(name: str, tmp_path) -> dict:
    """The JSON a component's quick run (`megarl bench --quick`'s arguments) writes."""
    from common import REPO_ROOT
    from components import COMPONENTS, command_for

    assert name in COMPONENTS
    out = tmp_path / f"{name}.json"
    cmd = command_for(name, True, out, sys.executable)
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())


def test_attention_component_headline_and_its_quick_run(tmp_path):
    from report import component_headline

    result = {"dtype": "bf16", "kernel_ms": {"32x68": {"median": {"explicit": 40.0, "math": 55.0, "flash": 135.0},
                                                         "ratio_to_explicit": {"math": 1.37, "flash": 3.37}}},
              "train_step_25m_bf16": {"median": {"explicit": 1.95, "math": 2.2, "flash": 2.84},
                                      "ratio_to_explicit": {"math": 1.12, "flash": 1.42}}}
    assert component_headline("attention", result) == (
        "bf16 fwd+bwd, explicit attention: 32x68 40 ms (math 1.37x, flash 3.37x); "
        "25M train step 1.95 s (math 1.12x, flash 1.42x)")
    # The quick run (one call of each way, kernel part only) writes the JSON the headline reads.
    written = _quick_component_run("attention", tmp_path)
    assert set(written["kernel_ms"]) == {"64x36", "32x68", "16x128", "8x192"}
    assert "train_step_25m_bf16" not in written
    assert component_headline("attention", written).startswith("bf16 fwd+bwd, explicit attention: 64x36 ")


def test_local_modules_component_headline_and_its_quick_run(tmp_path):
    from report import component_headline

    result = {"swiglu_ms": {"fp32": {"median": {"swiglu": 17.5, "megatron": 24.8}, "ratio_to_swiglu": {"megatron": 1.36}}},
              "rms_norm_ms": {"bf16": {"median": {"rms_norm": 8.5, "torch": 15.3}, "ratio_to_rms_norm": {"torch": 1.8}}},
              "train_step_25m_s": {"fp32": {"median": {"local": 4.29}, "ratio_to_local": {
                  "megatron_swiglu": 1.01, "torch_rms_norm": 1.02, "neither": 1.04}}}}
    assert component_headline("local_modules", result) == (
        "fwd+bwd: SwiGLU fp32 17.5 ms (Megatron's 1.36x); RMSNorm bf16 8.5 ms (torch's 1.8x); "
        "25M train step fp32 4.29 s (Megatron's SwiGLU 1.01x, torch's RMSNorm 1.02x, both 1.04x)")
    # The quick run (one call of each way, no train step) writes the JSON the headline reads.
    written = _quick_component_run("local_modules", tmp_path)
    assert set(written["swiglu_ms"]) == set(written["rms_norm_ms"]) == {"fp32", "bf16"}
    assert written["train_step_25m_s"] == {}
    assert component_headline("local_modules", written).startswith("fwd+bwd: SwiGLU fp32 ")


def test_report_gives_the_reward_over_seeds_with_its_standard_error():
    from e2e import reward_over_seeds
    from report import render_report

    bench = _fabricated_bench()
    steps = [{"step": i + 1, "step_s": 1.0, "score_mean": s} for i, s in enumerate([0.0, 0.5, 1.0])]
    bench["sections"]["e2e"]["result"]["reward_over_seeds"] = reward_over_seeds(
        [(1, steps, steps[:2]), (5, steps[:2], steps)], windows=2)
    md = render_report(bench)
    assert ("Reward against training time over 2 seeds (1, 5; one round each, each its own initial weights and "
            "prompts on both sides), over the 2 s every run covered: megarl / TRL 1; megarl - TRL per seed 0 +- 0 "
            "(standard error):") in md
    per_seed = next(t for t in _tables(md) if t[0] == ["seed", "megarl", "TRL", "megarl - TRL"])
    assert per_seed[1:] == [["1", "0.25", "0.25", "0"], ["5", "0.25", "0.25", "0"]]
    pooled = next(t for t in _tables(md) if t[0][0] == "time, seeds pooled")
    assert pooled[0][1:] == ["0-1 s", "1-2 s", "whole span"]
    # Both steps of each run end at 1 s and 2 s: in the second window ([1, 2]); none ends in [0, 1).
    assert pooled[1] == ["megarl", "-", "0.25", "0.25"]
