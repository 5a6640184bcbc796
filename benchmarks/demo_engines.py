"""The quickstart (`make demo`) with the HF engine vs the vLLM engine, at three worker layouts.

Each setting is a `megarl train configs/quickstart_cpu.yaml` run of `--steps` GRPO steps on the
demo's own task (2 operands 0..4, '+'), same seed, no validation or checkpoints; step and phase
times come from the run's metrics.jsonl, step 1 (warm-up) left out (see megarl_run.py).

Settings (engine x layout):
  hf_2w_tp2 / vllm_2w_tp2   2 workers, actor TP=2, 1 thread each
  hf_2w_dp2 / vllm_2w_dp2   2 workers, actor TP=1 (data parallel 2), 1 thread each (the quickstart
                            config as it is)
  hf_1w / vllm_1w           1 worker, actor TP=1, 2 threads (resources.num_cpus_per_worker=2)

The HF settings run with the main environment's interpreter (what `make demo` uses without vLLM),
the vLLM settings with the vLLM environment's (`make vllm-env`, mk/vllm.mk). Settings run in turn
within each round so that a busy machine slows them alike; the median over rounds is reported and
the fastest round too (on a shared machine it is the better estimate of the cost itself).

    python benchmarks/demo_engines.py                        # about 15 minutes on 2 CPU cores
    python benchmarks/demo_engines.py --rounds 1 --settings hf_2w_tp2,vllm_2w_tp2

Writes JSON to --out (default benchmarks/results/demo_engines.json).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO_ROOT, RESULTS_DIR, load_average, machine_info, write_json  # noqa: E402
from megarl_run import QUICKSTART, base_overrides, one_worker_overrides, run_megarl  # noqa: E402

ENVS = {"hf": REPO_ROOT / ".venv" / "bin" / "python", "vllm": REPO_ROOT / ".venv-vllm" / "bin" / "python"}
LAYOUTS = {
    "2w_tp2": (["actor.megatron.tensor_model_parallel_size=2"], 1),
    "2w_dp2": (["actor.megatron.tensor_model_parallel_size=1"], 1),
    "1w": ([*one_worker_overrides(), "resources.num_cpus_per_worker=2"], 2),
}
SETTINGS = {f"{engine}_{layout}": (engine, layout) for layout in LAYOUTS for engine in ENVS}
# The demo's task (Makefile, `demo` target).
TASK_ARGS = ["--num-operands", "2", "--min-value", "0", "--max-value", "4", "--operators", "+"]
PROMPTS, N = 8, 8  # data.train_batch_size and rollout.n of the quickstart config


def prepare_demo_task(work_dir: Path) -> dict[str, Path]:
    data = work_dir / "data"
    paths = {"train": data / "train.parquet", "val": data / "val.parquet", "tokenizer": data / "tokenizer"}
    if not (paths["train"].is_file() and (paths["tokenizer"] / "tokenizer.json").is_file()):
        subprocess.run([str(ENVS["hf"]), "-m", "megarl.cli", "data", "make", "arithmetic", "--out", str(data),
                        "--tokenizer-out", str(paths["tokenizer"]), *TASK_ARGS],
                       check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    return paths


def setting_overrides(name: str, task: dict[str, Path], run_dir: Path, steps: int) -> tuple[list[str], int]:
    engine, layout = SETTINGS[name]
    extra, threads = LAYOUTS[layout]
    return [*base_overrides(task, run_dir, steps), f"rollout.engine={engine}", *extra], threads


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def pooled_step_medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median over every timed step (step 1 left out) of every round: on a machine whose load comes and
    goes, robust to the rounds and steps a burst of other work fell on."""
    out = {}
    for key in ("step_s", "gen_s", "update_actor_s", "sync_weights_s"):
        values = [r[key] for run in runs for r in run["records"] if r["step"] > 1 and r.get(key) is not None]
        if values:
            out[f"{key}_pooled_median"] = round(statistics.median(values), 4)
    return out


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting: median and fastest over rounds of the mean step / generation / update time, and
    the medians over all timed steps of all rounds."""
    def per_run(key: str) -> list[float]:
        out = []
        for run in runs:
            s = run["summary"]
            out.append(s["step_s_mean"] if key == "step" else s["phase_seconds_mean"].get(key))
        return out

    summary: dict[str, Any] = {}
    for key in ("step", "gen", "sync_weights", "update_actor", "old_log_prob"):
        values = [v for v in per_run(key) if v is not None]
        if values:
            summary[f"{key}_s_median"] = round(median(values), 4)
            summary[f"{key}_s_min"] = round(min(values), 4)
    summary.update(pooled_step_medians(runs))
    summary["reward_first"] = [run["summary"]["reward_first"] for run in runs]
    summary["reward_last5_mean"] = [run["summary"]["reward_last_window_mean"] for run in runs]
    summary["wall_s"] = [run["wall_s"] for run in runs]
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated subset of {list(SETTINGS)}")
    parser.add_argument("--work-dir", type=Path, default=REPO_ROOT / "outputs" / "bench_demo_engines")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "demo_engines.json")
    args = parser.parse_args()
    names = [s for s in args.settings.split(",") if s]
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        parser.error(f"unknown settings {unknown}; valid: {list(SETTINGS)}")
    missing = sorted({str(ENVS[SETTINGS[n][0]]) for n in names if not ENVS[SETTINGS[n][0]].is_file()})
    if missing:
        parser.error(f"missing interpreters {missing}: run `make install` / `make vllm-env` first")

    task = prepare_demo_task(args.work_dir)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    commands: dict[str, list[str]] = {}
    start = time.time()
    for round_index in range(args.rounds):
        for name in names:
            run_dir = args.work_dir / f"{name}_r{round_index}"
            overrides, threads = setting_overrides(name, task, run_dir, args.steps)
            result = run_megarl(run_dir, overrides, prompts=PROMPTS, n=N, timeout_s=args.timeout_s,
                                threads_per_worker=threads, python=str(ENVS[SETTINGS[name][0]]))
            commands[name] = [f"OMP_NUM_THREADS={threads}", str(ENVS[SETTINGS[name][0]].relative_to(REPO_ROOT)),
                              "-m", "megarl.cli", "train", str(QUICKSTART.relative_to(REPO_ROOT)), *overrides]
            s = result["summary"]
            print(f"round {round_index} {name:12s} step {s['step_s_mean']:.3f} s  gen "
                  f"{s['phase_seconds_mean'].get('gen', float('nan')):.3f} s  update "
                  f"{s['phase_seconds_mean'].get('update_actor', float('nan')):.3f} s  reward "
                  f"{s['reward_first']:.3f} -> {s['reward_last_window_mean']:.3f}  wall {result['wall_s']:.0f} s",
                  flush=True)
            runs[name].append(result)
    summary = {name: summarise(results) for name, results in runs.items()}
    for results in runs.values():
        for result in results:
            result.pop("records")
    payload = {
        "benchmark": "demo_engines",
        "command": "python benchmarks/demo_engines.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "rounds": args.rounds,
        "machine": machine_info(),
        "load_average_end": load_average(),
        "elapsed_s": round(time.time() - start, 1),
        "settings": {name: {"engine": SETTINGS[name][0], "layout": SETTINGS[name][1], "run_command": commands[name]}
                     for name in names},
        "summary": summary,
        "runs": runs,
    }
    print(f"wrote {write_json(args.out, payload)}")
    for name, s in summary.items():
        print(f"{name:12s} step median {s.get('step_s_median')} (min {s.get('step_s_min')}, all steps "
              f"{s.get('step_s_pooled_median')})  gen median {s.get('gen_s_median')} (min {s.get('gen_s_min')}, "
              f"all steps {s.get('gen_s_pooled_median')})  update median {s.get('update_actor_s_median')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
