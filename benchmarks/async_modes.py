"""The quickstart task in synchronous, one-step-off, bounded-staleness and asynchronous mode, side by side.

Every mode runs `megarl train configs/async_cpu.yaml` (1 training process, 1 rollout process, the
quickstart's model and task, same seed) for `--steps` GRPO steps without validation or checkpoints,
in turn within each round so that a busy machine slows them alike. Per mode, from metrics.jsonl:

- step time and generated tokens/s (step 1, the warm-up, left out);
- time to a reward level: the run's cumulative step time when the mean training score over the
  last `--window` steps first reaches `--level`;
- idle shares: the training pool idles while it waits for generation (`timing_s/gen`); the rollout
  pool is busy generating (`async/rollout_busy_s`, its own measure) and in the weight sync
  (`timing_s/sync_weights`), idle the rest of the step;
- staleness of the trained rows (`async/staleness_mean`, a row's oldest token) and of their tokens
  (`async/token_staleness_mean`), the share of rows sampled across an update (`async/partial_rows`),
  and the rollout/trainer mismatch (`rollout_corr/kl_k3`).

Modes: sync (`trainer.async_mode=sync`, still the two pools), one_step_off, bounded_staleness with
`trainer.max_staleness=2`; async_partial, the same with partial rollout (a generation still running
when the update is done stops at its next token, takes the new weights and goes on:
`trainer.partial_rollout=continue`, one token a chunk); plus hybrid_1w, today's colocated layout (1 process, 2 threads, rollout
in the actor's process) as the reference.

    python benchmarks/async_modes.py                 # about 10 minutes on 2 CPU cores
    python benchmarks/async_modes.py --rounds 1 --steps 40 --modes sync,one_step_off
    python benchmarks/async_modes.py --long-responses 32 --out benchmarks/results/async_modes_long.json

`--long-responses R`: every response R tokens long (EOS ignored; the reward still reads the first
number), so that generation outlasts the update and partial rollouts get interrupted.

Writes JSON to --out (default benchmarks/results/async_modes.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO_ROOT, RESULTS_DIR, load_average, machine_info, write_json  # noqa: E402
from demo_engines import ENVS, prepare_demo_task  # noqa: E402
from megarl_run import base_overrides, run_megarl  # noqa: E402

CONFIG = REPO_ROOT / "configs" / "async_cpu.yaml"
PROMPTS, N = 8, 8  # data.train_batch_size and rollout.n of the config
MODES: dict[str, tuple[list[str], int]] = {  # overrides, threads per process
    "sync": (["trainer.async_mode=sync"], 1),
    "one_step_off": (["trainer.async_mode=one_step_off"], 1),
    "bounded_staleness": (["trainer.async_mode=bounded_staleness", "trainer.max_staleness=2"], 1),
    "async_partial": (["trainer.async_mode=bounded_staleness", "trainer.max_staleness=2",
                       "trainer.partial_rollout=continue", "trainer.partial_rollout_chunk_tokens=1"], 1),
    "hybrid_1w": (["trainer.async_mode=sync", "resources.rollout_pool=null", "rollout.free_cache_engine=true",
                   "resources.num_cpus_per_worker=2"], 2),
}


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if r["step"] >= 1), key=lambda r: r["step"])


def time_to_level(rows: list[dict[str, Any]], level: float, window: int) -> Optional[float]:
    """Cumulative step seconds when the mean score of the last `window` steps first reaches `level`."""
    elapsed, scores = 0.0, []
    for row in rows:
        m = row["metrics"]
        elapsed += m["timing_s/step"]
        scores.append(m["critic/score/mean"])
        if len(scores) >= window and statistics.mean(scores[-window:]) >= level:
            return round(elapsed, 3)
    return None


def summarise_run(rows: list[dict[str, Any]], level: float, window: int) -> dict[str, Any]:
    timed = [r["metrics"] for r in rows if r["step"] > 1]
    total = sum(m["timing_s/step"] for m in timed)

    def total_of(key: str) -> float:
        return sum(m.get(key, 0.0) for m in timed)

    response_tokens = sum(m["response_length/mean"] * PROMPTS * N for m in timed)
    rollout_busy = total_of("async/rollout_busy_s") + total_of("timing_s/sync_weights")
    return {
        "step_s_mean": round(total / len(timed), 4),
        "generated_tokens_per_s": round(response_tokens / total, 1),
        "gen_wait_s_mean": round(total_of("timing_s/gen") / len(timed), 4),
        "rollout_busy_s_mean": round(total_of("async/rollout_busy_s") / len(timed), 4),
        "update_actor_s_mean": round(total_of("timing_s/update_actor") / len(timed), 4),
        "sync_weights_s_mean": round(total_of("timing_s/sync_weights") / len(timed), 4),
        "training_idle_share": round(total_of("timing_s/gen") / total, 3),
        "rollout_idle_share": round(max(0.0, 1.0 - rollout_busy / total), 3),
        "staleness_mean": round(total_of("async/staleness_mean") / len(timed), 3),
        # Without partial rollout every token of a row has the row's version.
        "token_staleness_mean": round(sum(m.get("async/token_staleness_mean", m.get("async/staleness_mean", 0.0))
                                          for m in timed) / len(timed), 3),
        "partial_rows_mean": round(total_of("async/partial_rows") / len(timed), 3),
        "mismatch_kl_k3_mean": round(total_of("rollout_corr/kl_k3") / len(timed), 6),
        "time_to_level_s": time_to_level(rows, level, window),
        "score_first10_mean": round(statistics.mean(r["metrics"]["critic/score/mean"] for r in rows[:10]), 3),
        "score_last10_mean": round(statistics.mean(r["metrics"]["critic/score/mean"] for r in rows[-10:]), 3),
    }


def median_of(results: list[dict[str, Any]], key: str) -> Optional[float]:
    values = [r[key] for r in results if r.get(key) is not None]
    return round(statistics.median(values), 4) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {list(MODES)}")
    parser.add_argument("--engine", choices=sorted(ENVS), default="hf")
    parser.add_argument("--level", type=float, default=0.3, help="reward level for the time-to-level measure")
    parser.add_argument("--window", type=int, default=10, help="steps the reward level is averaged over")
    parser.add_argument("--work-dir", type=Path, default=REPO_ROOT / "outputs" / "bench_async_modes")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "async_modes.json")
    parser.add_argument("--quick", action="store_true", help="1 round of 20 steps (a smoke run)")
    parser.add_argument("--long-responses", type=int, default=0,
                        help="responses of exactly this many tokens (rollout.ignore_eos); 0: the task's own")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 20
    names = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(names) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; valid: {list(MODES)}")
    python = ENVS[args.engine]
    if not python.is_file():
        parser.error(f"missing interpreter {python}: run `make install` / `make vllm-env` first")

    task = prepare_demo_task(args.work_dir)
    per_mode: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    commands: dict[str, list[str]] = {}
    start = time.time()
    for round_index in range(args.rounds):
        for name in names:
            extra, threads = MODES[name]
            run_dir = args.work_dir / f"{name}_r{round_index}"
            overrides = [*base_overrides(task, run_dir, args.steps), f"rollout.engine={args.engine}", *extra]
            if args.long_responses:
                overrides += [f"data.max_response_length={args.long_responses}", "rollout.ignore_eos=true"]
            result = run_megarl(run_dir, overrides, prompts=PROMPTS, n=N, timeout_s=args.timeout_s,
                                threads_per_worker=threads, python=str(python), config=CONFIG)
            commands[name] = [f"OMP_NUM_THREADS={threads}", str(python.relative_to(REPO_ROOT)), "-m", "megarl.cli",
                              "train", str(CONFIG.relative_to(REPO_ROOT)), *overrides]
            s = summarise_run(read_rows(run_dir), args.level, args.window)
            s["wall_s"] = result["wall_s"]
            s["load_average_after"] = result["load_average_after"]
            per_mode[name].append(s)
            print(f"round {round_index} {name:17s} step {s['step_s_mean']:.3f} s  {s['generated_tokens_per_s']:.0f} "
                  f"gen tok/s  idle train {s['training_idle_share']:.2f} rollout {s['rollout_idle_share']:.2f}  "
                  f"staleness {s['staleness_mean']:.2f}  to {args.level} in {s['time_to_level_s']} s  "
                  f"score {s['score_first10_mean']:.2f} -> {s['score_last10_mean']:.2f}", flush=True)
    keys = ("step_s_mean", "generated_tokens_per_s", "training_idle_share", "rollout_idle_share", "time_to_level_s",
            "staleness_mean", "token_staleness_mean", "partial_rows_mean", "mismatch_kl_k3_mean", "gen_wait_s_mean",
            "rollout_busy_s_mean", "update_actor_s_mean", "sync_weights_s_mean", "score_last10_mean")
    summary = {name: {key: median_of(results, key) for key in keys} for name, results in per_mode.items()}
    if "sync" in summary:
        base = summary["sync"]["step_s_mean"]
        for name, s in summary.items():
            s["step_time_vs_sync"] = round(s["step_s_mean"] / base, 3) if base and s["step_s_mean"] else None
    payload = {
        "benchmark": "async_modes",
        "command": "python benchmarks/async_modes.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "rounds": args.rounds,
        "engine": args.engine,
        "long_responses": args.long_responses,
        "reward_level": {"level": args.level, "window": args.window},
        "machine": machine_info(),
        "load_average_end": load_average(),
        "elapsed_s": round(time.time() - start, 1),
        "run_commands": commands,
        "summary": summary,
        "runs": per_mode,
    }
    print(f"wrote {write_json(args.out, payload)}")
    for name, s in summary.items():
        print(f"{name:17s} " + "  ".join(f"{k}={v}" for k, v in s.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
