"""Markdown report of a benchmark run (`bench.json` -> `REPORT.md`).

Pure formatting: `render_report(bench)` takes the dictionary `run_all.py` writes and returns the
markdown text; it never measures anything. Missing numbers print as "-"; a failed section prints
its status and the first lines of its error.

    python benchmarks/report.py benchmarks/results/bench.json [--out benchmarks/results/REPORT.md]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SECTION_TITLES = {
    "e2e": "End to end: megarl vs TRL GRPOTrainer (same machine, same task and budget)",
    "e2e_25m": "End to end at ~25M parameters, 64-token responses: megarl vs TRL GRPOTrainer, with MFU",
    "phases": "Phase breakdown of a megarl step",
    "scaling": "Scaling: workers and model size",
    "components": "Component benchmarks",
    "async_modes": ("Synchronous, one-step-off, bounded-staleness and asynchronous (partial rollout) training "
                    "(separate rollout pool)"),
    "gpu": "GPU",
}


def reward_plot_name(size: str) -> str:
    """The reward-vs-time plot of the end-to-end comparison at `size` (quickstart, 25m), as the
    report names it; benchmarks/e2e.py writes it under that name beside the results."""
    return f"e2e_{size}_reward_vs_time.png"


def fmt(value: Any, digits: int = 3) -> str:
    """A number with `digits` significant digits ("-" for None); other values as text."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.{digits}g}"
        return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:,.0f}"
    return str(value)


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def load(values: Sequence[float] | None) -> str:
    return "-" if not values else " / ".join(f"{v:.1f}" for v in values)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table; cells are formatted with `fmt` unless already strings."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in row) + " |")
    return lines


def _e2e(result: dict[str, Any]) -> list[str]:
    m, t = result["megarl"], result["trl"]
    ms, ts, r = m["summary"], t["summary"], result["ratios_megarl_over_trl"]
    rows = [
        ["step time (s, mean of steps 2..N)", ms["step_s_mean"], ts["step_s_mean"], r["step_time"]],
        ["wall clock per step (s, from the previous step's end)", ms.get("wall_step_s_mean"),
         ts.get("wall_step_s_mean"), r.get("wall_step_time")],
        ["generated tokens/s", ms["generated_tokens_per_s"], ts["generated_tokens_per_s"], r["generated_tokens_per_s"]],
        ["training tokens/s (prompt + response)", ms["training_tokens_per_s"], ts["training_tokens_per_s"],
         r["training_tokens_per_s"]],
        ["peak memory, workload (MiB)", m["memory"]["workload_mib"], t["memory"]["workload_mib"], r["peak_memory_workload"]],
        ["peak memory, whole tree (MiB)", m["memory"]["tree_mib"], t["memory"]["tree_mib"], None],
        ["reward, step 1", ms["reward_first"], ts["reward_first"], None],
        [f"reward, mean of last {ms['reward_window']} steps", ms["reward_last_window_mean"], ts["reward_last_window_mean"],
         r["reward_last_window"]],
        ["wall time of the run incl. start-up (s)", m["wall_s"], t["wall_s"], None],
        ["load average (1/5/15 min) before the run", load(m.get("load_average_before")),
         load(t.get("load_average_before")), ""],
    ]
    header = ["", "megarl", f"TRL ({result.get('trl', {}).get('torch_threads', '?')} threads)", "megarl / TRL"]
    # Extra TRL runs (e.g. 1 thread) as further column pairs, same rows.
    for name, variant in result.get("trl_variants", {}).items():
        if "summary" not in variant:
            continue
        vs, vr = variant["summary"], result["ratios_megarl_over_trl_variants"][name]
        extra = [(vs["step_s_mean"], vr["step_time"]), (vs.get("wall_step_s_mean"), vr.get("wall_step_time")),
                 (vs["generated_tokens_per_s"], vr["generated_tokens_per_s"]),
                 (vs["training_tokens_per_s"], vr["training_tokens_per_s"]),
                 (variant["memory"]["workload_mib"], vr["peak_memory_workload"]),
                 (variant["memory"]["tree_mib"], None), (vs["reward_first"], None),
                 (vs["reward_last_window_mean"], vr["reward_last_window"]), (variant["wall_s"], None),
                 (load(variant.get("load_average_before")), "")]
        header += [f"TRL ({name})", f"megarl / TRL ({name})"]
        for row, (value, rat) in zip(rows, extra):
            row += [value, rat]
    lines = table(header, rows)
    lines += _e2e_rounds(result.get("rounds") or {})
    curves = {"megarl": _scores(m), "TRL": _scores(t)}
    steps = max(len(c) for c in curves.values())
    if steps >= 8:
        block = steps // 8
        lines += ["", f"Mean reward per block of {block} steps (same prompts in the same order on both sides):", ""]
        starts = list(range(0, steps, block))
        lines += table(["steps", *[f"{s + 1}-{min(s + block, steps)}" for s in starts]],
                       [[name, *[_block_mean(c, s, block) for s in starts]] for name, c in curves.items()])
    timed = result.get("reward_vs_wall_clock", {})
    if "window_edges_s" in timed:
        edges = timed["window_edges_s"]
        lines += ["", (f"Mean step reward against training time (sum of step times), over the {fmt(timed['span_s'])} s "
                       f"both ran; megarl / TRL over that span: {fmt(timed['reward_ratio_at_equal_time'])} (plot: "
                       f"`{reward_plot_name(result.get('setup', {}).get('size', 'quickstart'))}`):"), ""]
        windows = [f"{fmt(a, 2)}-{fmt(b, 2)} s" for a, b in zip(edges, edges[1:])]
        lines += table(["time", *windows, "whole span", "steps"],
                       [[name, *timed[f"{key}_window_mean"], timed[f"{key}_mean_in_span"], timed[f"{key}_steps_in_span"]]
                        for name, key in (("megarl", "megarl"), ("TRL", "trl"))])
    lines += _e2e_seeds(result.get("reward_over_seeds") or {})
    setup = result.get("setup", {})
    if setup:
        lines += ["", "Setup:", ""] + [f"- {k}: {v}" for k, v in setup.items()]
    return lines


def _e2e_seeds(pooled: dict[str, Any]) -> list[str]:
    """Reward against training time pooled over one round per seed (`e2e.py --seeds`)."""
    if "window_edges_s" not in pooled:
        return []
    edges, seeds = pooled["window_edges_s"], pooled.get("seeds") or []
    error = pooled.get("difference_standard_error")
    lines = ["", (f"Reward against training time over {len(seeds)} seeds ({', '.join(map(str, seeds))}; one round each, "
                  f"each its own initial weights and prompts on both sides), over the {fmt(pooled['span_s'])} s every run "
                  f"covered: megarl / TRL {fmt(pooled['reward_ratio_at_equal_time'])}; megarl - TRL per seed "
                  f"{fmt(pooled['difference_mean'])}" + (f" +- {fmt(error)} (standard error)" if error is not None else "")
                  + ":"), ""]
    windows = [f"{fmt(a, 2)}-{fmt(b, 2)} s" for a, b in zip(edges, edges[1:])]
    lines += table(["time, seeds pooled", *windows, "whole span"],
                   [[name, *pooled[f"{key}_window_mean"], pooled[f"{key}_mean_in_span"]]
                    for name, key in (("megarl", "megarl"), ("TRL", "trl"))])
    lines += ["", *table(["seed", "megarl", "TRL", "megarl - TRL"],
                         [[str(r["seed"]), r["megarl_mean_in_span"], r["trl_mean_in_span"], r["difference"]]
                          for r in pooled.get("per_seed", [])])]
    return lines


def _e2e_rounds(rounds: dict[str, Any]) -> list[str]:
    """The megarl/TRL pair run several times in turn: each round's ratios, then their median and
    range (the table above and the rest of the section are round 1's)."""
    per_round, summary = rounds.get("per_round") or [], rounds.get("summary") or {}
    if len(per_round) < 2:
        return []
    keys = (("step_time", "step time, megarl / TRL"), ("wall_step_time", "wall clock per step, megarl / TRL"),
            ("generated_tokens_per_s", "generated tokens/s, megarl / TRL"),
            ("reward_ratio_at_equal_time", "reward over the common time span, megarl / TRL"))
    rows = [["megarl step (s)", *[r.get("megarl_step_s") for r in per_round], "", ""],
            ["TRL step (s)", *[r.get("trl_step_s") for r in per_round], "", ""]]
    for key, label in keys:
        s = summary.get(key) or {}
        span = f"{fmt(s.get('min'))}-{fmt(s.get('max'))}" if s else ""
        rows.append([label, *[r.get(key) for r in per_round], s.get("median"), span])
    return (["", f"The pair ran {len(per_round)} times in turn ({rounds.get('order', 'megarl then TRL')}); "
             "the table above is round 1's. Each round's ratios, their median and range:", ""]
            + table(["", *[f"round {i + 1}" for i in range(len(per_round))], "median", "range"], rows))


def _scores(run: dict[str, Any]) -> list[float]:
    return [r["score_mean"] for r in run.get("records", []) if r.get("score_mean") is not None]


def _block_mean(values: list[float], start: int, size: int) -> float | None:
    chunk = values[start:start + size]
    return sum(chunk) / len(chunk) if chunk else None


def _phases(result: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for name, run in result.get("runs", {}).items():
        shares, seconds = run["phase_shares"], run["phase_seconds_mean"]
        order = sorted(shares, key=lambda p: -shares[p])
        rows = [[f"**{p}**" if p == run["biggest_phase"] else p, seconds.get(p), pct(shares[p])] for p in order]
        lines += [f"**{name}** (mean step {fmt(run['step_s_mean'])} s over {run['timed_steps']} steps; "
                  f"load before {load(run.get('load_average_before'))})", ""]
        lines += table(["phase", "mean s", "share of step"], rows) + [""]
    for name, err in result.get("errors", {}).items():
        lines += [f"{name}: failed - {_first_lines(err)}", ""]
    return lines


def _scaling(result: dict[str, Any]) -> list[str]:
    rows = [[r["name"], r["workers"], r["layers"], r["parameters"], r["step_s_mean"], r["step_time_over_base"],
             r["generated_tokens_per_s"], r["training_tokens_per_s"], r["peak_memory_workload_mib"],
             load(r.get("load_average_before"))] for r in result.get("runs", [])]
    lines = table(["run", "workers", "layers", "parameters", "step s", "x base", "gen tok/s", "train tok/s",
                   "peak MiB", "load before"], rows)
    runs = result.get("runs", [])
    phases = [p for p in dict.fromkeys(p for r in runs for p in r.get("phase_seconds_mean", {}))]
    if phases:
        lines += ["", "Mean seconds per phase:", ""]
        lines += table(["run", *phases], [[r["name"], *[r["phase_seconds_mean"].get(p) for p in phases]] for r in runs])
    for name, err in result.get("errors", {}).items():
        lines += ["", f"{name}: failed - {_first_lines(err)}"]
    return lines


def _algorithms(r: dict[str, Any]) -> str:
    return "; ".join(f"{x['estimator']}: {fmt(x['vectorised_tokens_per_s'])} tok/s, {fmt(x['speedup'])}x the plain loop"
                     for x in r["results"])


def _engine(r: dict[str, Any]) -> str:
    lp, tr = r["log_prob_tokens_per_s"], r["train_step_tokens_per_s"]
    return (f"{fmt(r['params'])} params; log-prob {fmt(lp['engine'])} tok/s (engine/HF {fmt(lp['engine'] / lp['hf'])}); "
            f"train step {fmt(tr['engine'])} tok/s (engine/HF {fmt(tr['engine'] / tr['hf'])})")


def _reshard(r: dict[str, Any]) -> str:
    """The largest model measured: sync seconds per layout, bytes moved over the minimum, time over a plain copy."""
    largest = max(x["params"] for x in r["results"])
    rows = [x for x in r["results"] if x["params"] == largest]
    return f"{rows[0]['size']} params: " + "; ".join(
        f"{x['layout']} {fmt(x['sync_seconds'])} s (moved/min {fmt(x['moved_over_minimum'])}, "
        f"x{fmt(x['sync_over_floor'])} a copy)" for x in rows)


def _rollout(r: dict[str, Any]) -> str:
    parts = [f"{name} {fmt(e['tokens_per_s'])} tok/s" for name, e in r["engines"].items()]
    # Results written before benchmarks/rollout.py took --device ran the HF engine on the CPU.
    device = r.get("config", {}).get("hf_device", "cpu")
    if device != "cpu" or r.get("machine", {}).get("cuda"):
        parts[0] = f"HF engine on {'the host CPU' if device == 'cpu' else device}: {parts[0]}"
    if "vllm_over_hf" in r:
        parts.append(f"vLLM/HF {fmt(r['vllm_over_hf'])}")
    elif "vllm_skipped" in r:
        parts.append(f"vLLM not measured ({str(r['vllm_skipped'])[:80]})")
    return "; ".join(parts)


def _convert(r: dict[str, Any]) -> str:
    s, a = r["results"]["streaming"], r["results"]["load_all"]
    return (f"{fmt(r['model_mib'])} MiB model, HF -> Megatron: streaming {fmt(s['seconds'])} s, "
            f"+{fmt(s['peak_over_base_mib'])} MiB peak; load-all {fmt(a['seconds'])} s, +{fmt(a['peak_over_base_mib'])} MiB")


def _recompute(r: dict[str, Any]) -> str:
    return f"{fmt(r['results']['none']['params'])} params: " + "; ".join(
        f"{name} step peak {fmt(x['step_alloc_peak_mib'])} MiB (x{fmt(x['step_alloc_peak_ratio'])}), "
        f"time x{fmt(x['step_time_ratio'])}" for name, x in r["results"].items())


def _memory_phases(r: dict[str, Any]) -> str:
    s = r["summary"]
    return (f"{fmt(s['parameters'])} params: update-phase peak RSS drops {fmt(s['update_peak_drop_gb'])} GiB when the "
            f"rollout sleeps ({fmt(s['drop_over_weight_copy'])}x its {fmt(s['rollout_weight_copy_gb'])} GiB weight "
            f"copy); step time sleep/resident {fmt(s['step_time_sleep_over_resident'])}, "
            f"offload/resident {fmt(s['step_time_offload_over_resident'])}")


def _plan_scale(r: dict[str, Any]) -> str:
    """Per-rank sync planning: time and peak memory of one rank's plan at each world size."""
    parts = [f"{x['world_size']} ranks {fmt(x['max_seconds'])} s / {fmt(x['max_peak_mib'])} MiB" for x in r["results"]]
    full = [f"{x['world_size']} ranks {fmt(x['full_planner']['seconds'])} s" for x in r["results"] if "full_planner" in x]
    moe_texts = []
    for key in ("moe", "moe_vllm"):  # into the HF engine at rollout TP 1; into vLLM at rollout TP > 1
        moe = r.get(key) or {}
        moe_parts = [f"{x['world_size']} ranks {fmt(x['max_seconds'])} s / {fmt(x['max_peak_mib'])} MiB"
                     for x in moe.get("results", [])]
        if moe_parts:
            moe_texts.append(f"; {moe['model']} with EP into {moe['engine']} TP{moe['rollout_tp']}: "
                             + "; ".join(moe_parts))
    return (f"{r['model']}, one rank's plan: " + "; ".join(parts)
            + (f" (whole-world planner: {'; '.join(full)})" if full else "") + "".join(moe_texts))


def _reliability_headline(r: dict[str, Any]) -> str:
    """Faults detected / survived of the reliability component (benchmarks/reliability.py)."""
    done = [o for o in r["outcomes"] if "error" not in o]
    return (f"{sum(o['detected'] for o in done)}/{len(r['outcomes'])} faults detected, "
            f"{sum(o['survived'] for o in done)} survived, data lost in "
            f"{sum(not o['data_lost'].startswith('none') for o in done)}")  # "none (a copy was damaged; ...)"


def _reliability(r: dict[str, Any]) -> list[str]:
    """The Reliability section: one row per injected fault (benchmarks/reliability.py's JSON)."""
    rows = []
    for o in r["outcomes"]:
        if "error" in o:
            rows.append([o["fault"], f"scenario failed: {_first_lines(o['error'], 1)}", "-", "-", "-"])
            continue
        resumed = o.get("details", {}).get("resume_exit_code")
        survived = ("yes" if o["survived"] else "no") + ("" if resumed is None else " (rerun resumed)" if o["survived"]
                                                         else " (rerun failed)")
        rows.append([o["fault"], "yes" if o["detected"] else "no", survived, o["data_lost"], o["time_to_detect_s"]])
    return table(["fault", "detected", "survived / resumed", "data lost", "time to detect (s)"], rows)


def _generic(r: dict[str, Any]) -> str:
    numbers = [(k, v) for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return "; ".join(f"{k} {fmt(v)}" for k, v in numbers[:8]) or "(see JSON)"


def _batch_transfer(r: dict[str, Any]) -> str:
    torch_row, batch_row = r["results"]["torch"], r["results"]["batch"]
    return (f"actor round trip of a {r['setup']['rows']}-row step batch: {fmt(batch_row['actor_round_trip_ms'])} ms "
            f"(torch-tensor pickling {fmt(torch_row['actor_round_trip_ms'])} ms, "
            f"{fmt(r['speedup_torch_over_batch']['actor_round_trip_ms'])}x)")


def _attention(r: dict[str, Any]) -> str:
    """Half-precision training attention (benchmarks/attention.py): explicit attention's time and the
    math and flash kernels' pair ratios to it, per shape and for the 25M train step."""
    parts = [f"{shape} {fmt(k['median']['explicit'])} ms (math {fmt(k['ratio_to_explicit']['math'])}x, "
             f"flash {fmt(k['ratio_to_explicit']['flash'])}x)" for shape, k in r["kernel_ms"].items()]
    text = f"{r['dtype']} fwd+bwd, explicit attention: " + "; ".join(parts)
    step = r.get("train_step_25m_bf16")
    if step:
        text += (f"; 25M train step {fmt(step['median']['explicit'])} s (math "
                 f"{fmt(step['ratio_to_explicit']['math'])}x, flash {fmt(step['ratio_to_explicit']['flash'])}x)")
    return text


def _local_modules(r: dict[str, Any]) -> str:
    """The local spec's SwiGLU and RMSNorm (benchmarks/local_modules.py): their times and the pair
    ratios of what they replace, alone and in the 25M train step, per dtype."""
    parts = [f"SwiGLU {dtype} {fmt(a['median']['swiglu'])} ms (Megatron's {fmt(a['ratio_to_swiglu']['megatron'])}x)"
             for dtype, a in r["swiglu_ms"].items()]
    parts += [f"RMSNorm {dtype} {fmt(a['median']['rms_norm'])} ms (torch's {fmt(a['ratio_to_rms_norm']['torch'])}x)"
              for dtype, a in r["rms_norm_ms"].items()]
    parts += [f"25M train step {dtype} {fmt(s['median']['local'])} s (Megatron's SwiGLU "
              f"{fmt(s['ratio_to_local']['megatron_swiglu'])}x, torch's RMSNorm {fmt(s['ratio_to_local']['torch_rms_norm'])}x, "
              f"both {fmt(s['ratio_to_local']['neither'])}x)"
              for dtype, s in r.get("train_step_25m_s", {}).items()]
    return "fwd+bwd: " + "; ".join(parts)


COMPONENT_HEADLINES: dict[str, Callable[[dict[str, Any]], str]] = {
    "algorithms": _algorithms, "engine": _engine, "reshard": _reshard, "rollout": _rollout, "convert": _convert,
    "recompute": _recompute, "memory_phases": _memory_phases, "plan_scale": _plan_scale,
    "reliability": _reliability_headline, "batch_transfer": _batch_transfer, "attention": _attention,
    "local_modules": _local_modules,
}


def component_headline(name: str, result: dict[str, Any]) -> str:
    """One line of the most telling numbers of a component's JSON (generic when its layout is unknown)."""
    try:
        return COMPONENT_HEADLINES.get(name, _generic)(result)
    except (KeyError, TypeError, ZeroDivisionError):
        return _generic(result)


def _components(result: dict[str, Any]) -> list[str]:
    rows = []
    for name, entry in result.get("components", {}).items():
        detail = component_headline(name, entry["result"]) if entry["status"] == "ok" else _first_lines(entry.get("error", ""))
        rows.append([name, entry["status"], entry.get("seconds"), load(entry.get("load_average_before")),
                     entry.get("measured_utc", "-"), detail])
    return table(["component", "status", "seconds", "load before", "measured (UTC)", "numbers"], rows)


def _gpu(result: dict[str, Any]) -> list[str]:
    if "skipped" in result:
        return [f"Skipped: {result['skipped']}."]
    rows = []
    train = result.get("train_step", {})
    if train.get("status") == "ok":
        r = train["result"]
        for phase, key in (("log-prob pass", "log_prob_tokens_per_s"), ("train step", "train_step_tokens_per_s")):
            tps = r[key]
            rows.append([f"{phase} tokens/s (benchmarks/gpu.py, 0.5B shape, bf16): engine / packed / HF",
                         f"{fmt(tps['engine'])} / {fmt(tps['engine_packed'])} / {fmt(tps['hf'])} "
                         f"({fmt(tps['engine'] / tps['hf'])}x HF)"])
        rows.append(["train-step MFU: Megatron engine / HF", f"{pct(train.get('mfu_train_step'))} / "
                     f"{pct(train.get('mfu_train_step_hf'))}"])
    else:
        rows.append(["train step", train.get("status", "-")])
    roll = result.get("rollout", {})
    rows.append(["rollout tokens/s", component_headline("rollout", roll["result"]) if roll.get("status") == "ok"
                 else roll.get("status", "-")])
    sync = result.get("sync", {})
    rows.append(["weight sync (gloo, host CPU)", component_headline("reshard", sync["result"]) if sync.get("status") == "ok"
                 else sync.get("status", "-")])
    shared = result.get("prompt_sharing", {})
    if shared.get("status") == "ok":  # benchmarks/engine.py --group-size 8 (GRPO's layout)
        r = shared["result"]
        tps = r["log_prob_tokens_per_s"], r["train_step_tokens_per_s"]
        rows.append(["prompt sharing (0.5B, bf16, 4 prompts x 8 responses, 512+128 tokens): log-prob / "
                     "train-step tokens/s, shared vs padded engine",
                     f"{fmt(tps[0]['engine_shared'])} vs {fmt(tps[0]['engine'])} ({fmt(shared['speedup']['log_prob'])}x) / "
                     f"{fmt(tps[1]['engine_shared'])} vs {fmt(tps[1]['engine'])} ({fmt(shared['speedup']['train_step'])}x)"])
    for variant in result.get("core_attention", []):  # benchmarks/engine.py --core-attention, one call
        tps = variant["log_prob_tokens_per_s"], variant["train_step_tokens_per_s"]
        rows.append([f"core attention {variant['name']}: log-prob / train-step tokens/s, engine (packed)",
                     f"{fmt(tps[0]['engine'])} ({fmt(tps[0]['engine_packed'])}) / {fmt(tps[1]['engine'])} "
                     f"({fmt(tps[1]['engine_packed'])}); HF {fmt(tps[0]['hf'])} / {fmt(tps[1]['hf'])}"])
    check = result.get("gpu_check")
    lines = [f"Device: {result.get('device')}", ""]
    if check:
        lines += [f"`tools/gpu_check.sh` (each call's `bundle:` line in the raw summaries says how its packages "
                  f"were installed): {check['steps']}; colocated GRPO run "
                  f"({check['train_steps']} steps, bf16, every actor offload key on): peak device memory "
                  f"{fmt(check['colocated_peak_ratio_max'])}x the larger phase peak (limit 1.1). Raw files: "
                  f"`{check['files']}`.", ""]
    return lines + table(["measure", "value"], rows)


def _async_modes(result: dict[str, Any]) -> list[str]:
    level = result.get("reward_level", {})
    rows = [[name, fmt(s.get("step_s_mean")), fmt(s.get("step_time_vs_sync")), fmt(s.get("generated_tokens_per_s")),
             fmt(s.get("training_idle_share")), fmt(s.get("rollout_idle_share")), fmt(s.get("staleness_mean")),
             fmt(s.get("token_staleness_mean")), fmt(s.get("partial_rows_mean")), fmt(s.get("mismatch_kl_k3_mean")),
             fmt(s.get("time_to_level_s")), fmt(s.get("score_last10_mean"))]
            for name, s in result.get("summary", {}).items()]
    return [f"{result.get('steps')} steps x {result.get('rounds')} rounds, {result.get('engine')} engine, medians; "
            f"time to a mean score of {level.get('level')} over {level.get('window')} steps "
            "(`benchmarks/async_modes.py`).", ""] + table(
        ["mode", "step s", "vs sync", "gen tok/s", "training idle", "rollout idle", "staleness", "token staleness",
         "rows across an update", "KL k3",
         f"s to {level.get('level')}", "score last 10"], rows)


def _e2e_25m(result: dict[str, Any]) -> list[str]:
    """The e2e table, then the useful-token MFU of the update and log-prob phases."""
    mfu = result.get("mfu", {})
    precision = mfu.get("mfu_precision", "fp32")
    rate = mfu.get(f"matmul_{precision}_flops_per_s")
    measured = mfu.get(f"matmul_{precision}_flops_per_s_measured")
    if measured:
        when = f"the best of {', '.join(fmt(r / 1e9) for r in measured)} measured before, between and after round 1's two runs"
    else:  # records written before the rate was measured more than once
        when = "measured in the same run"
    lines = _e2e(result) + ["", f"Useful-token MFU against torch.mm {precision} at {fmt(rate / 1e9 if rate else None)} GFLOP/s "
                                f"(2 threads, {when}), {fmt(mfu.get('useful_params'))} parameters "
                                "multiplying each token:", ""]
    rows = [["megarl update (6 x params x tokens it ran)", mfu.get("megarl_update_mfu")],
            ["megarl old log-prob pass (2 x params x tokens)", mfu.get("megarl_old_log_prob_mfu")],
            ["TRL training (step minus generation and scoring; 6 x params x tokens)", mfu.get("trl_training_mfu")]]
    phases = result["megarl"]["summary"].get("phase_seconds_mean", {})
    lines += table(["phase", "MFU"], rows)
    lines += ["", "megarl's phases (s, mean of steps 2..N): "
              + ", ".join(f"{k} {fmt(v)}" for k, v in phases.items()), ""]
    if mfu.get("megarl_update_rows_skipped_mean") is not None:
        lines += [f"megarl's update left out {pct(mfu['megarl_update_rows_skipped_mean'])} of the rows (mean of steps "
                  f"2..N), those of zero advantage (`actor.skip_zero_advantage_rows`), and ran "
                  f"{fmt(mfu.get('megarl_update_tokens_per_step'))} of {fmt(mfu.get('megarl_tokens_per_step'))} "
                  "tokens a step; TRL computes every row.", ""]
    return lines


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "e2e": _e2e, "e2e_25m": _e2e_25m, "phases": _phases, "scaling": _scaling, "components": _components, "async_modes": _async_modes,
    "gpu": _gpu,
}


def _first_lines(text: str, n: int = 3) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return " / ".join(lines[-n:]).replace("|", "\\|")[:400] or "(no message)"


def _machine(entry: dict[str, Any]) -> str:
    """Where a section ran: its GPU, else its CPU model and features ("-" in records older than the
    CPU field; sections of one report can come from different machines)."""
    machine = entry.get("result", {}).get("machine", {}) if isinstance(entry.get("result"), dict) else {}
    name = machine.get("cuda") or machine.get("cpu") or "-"
    return str(name).replace("|", "\\|")


def render_report(bench: dict[str, Any]) -> str:
    """The markdown report of one `bench.json` dictionary."""
    machine = bench.get("machine", {})
    out = [
        "# megarl benchmark report",
        "",
        f"Generated {bench.get('generated_utc', '-')} on {machine.get('cpu_count', '-')} CPUs "
        f"({', '.join(x for x in (machine.get('cpu'), machine.get('platform', '-')) if x)}), torch {machine.get('torch', '-')}, GPU: {machine.get('cuda') or 'none'}. "
        f"{'Quick (smoke) sizes. ' if bench.get('quick') else ''}"
        "Load average (1/5/15 min) is shown next to each number: on a shared machine, compare numbers taken "
        "under similar load only.",
        "",
        "| section | status | seconds | load before | load after | measured (UTC) | machine |",
        "|---|---|---|---|---|---|---|",
    ]
    sections = bench.get("sections", {})
    for name, entry in sections.items():
        out.append(f"| {name} | {entry['status']} | {fmt(entry.get('seconds'))} | {load(entry.get('load_average_before'))} "
                   f"| {load(entry.get('load_average_after'))} | {entry.get('finished_utc', '-')} | {_machine(entry)} |")
    for name, entry in sections.items():
        out += ["", f"## {SECTION_TITLES.get(name, name)}", ""]
        if entry["status"] != "ok":
            out += [f"Status **{entry['status']}**: {_first_lines(entry.get('error', ''), 6)}", ""]
        if "result" not in entry:
            continue
        try:
            out += RENDERERS.get(name, lambda r: ["```", json.dumps(r, indent=2)[:3000], "```"])(entry["result"])
        except (KeyError, TypeError) as err:  # a result of an older layout must not break the report
            out.append(f"(could not format this section: {type(err).__name__}: {err}; see bench.json)")
    reliability = sections.get("components", {}).get("result", {}).get("components", {}).get("reliability", {})
    if reliability.get("status") == "ok":
        out += ["", "## Reliability: injected faults (benchmarks/reliability.py)", ""] + _reliability(reliability["result"])
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench_json", type=Path)
    p.add_argument("--out", type=Path, default=None, help="default: REPORT.md next to the JSON")
    args = p.parse_args(argv)
    out = args.out or args.bench_json.with_name("REPORT.md")
    out.write_text(render_report(json.loads(args.bench_json.read_text())))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
