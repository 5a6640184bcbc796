"""Phase breakdown of a megarl step: each phase's share of the step time, biggest phase first.

Phases (timing_s/<phase> in metrics.jsonl): sync_weights (reshard trainer -> rollout), gen,
reward, old_log_prob, ref, values, adv, update_critic, update_actor; `other` is the rest of the
step (loading prompts, driver bookkeeping, metrics). With `trainer.queue_generation` (the
quickstart's default) the weight sync of steps 2.. is queued behind the update with the next
generation and has no `timing_s/sync_weights`: its time is inside `gen` (its own length is
`sync/seconds_max`), and only step 1, left out as warm-up, logs the phase. Two setups by default: GRPO as in the
quickstart (no reference, no critic) and PPO (GAE with a critic, KL loss against a reference), so
that every phase appears once.

    python benchmarks/phases.py [--steps 10] [--setups grpo,ppo] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, load_average, machine_info, write_json  # noqa: E402
from megarl_run import base_overrides, prepare_task, run_megarl  # noqa: E402

PROMPTS, N = 8, 8
SETUPS: dict[str, list[str]] = {
    "grpo": [],
    # Critic and reference share the actor's processes, so they take its layout (the quickstart's
    # DP=2; a layout of their own is refused unless they get a pool of their own), and its
    # micro-batch size (the quickstart's 32 sequences; their defaults, 4 and 8, would make them
    # look several times slower than the actor for the same work).
    "ppo": ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.001",
            "critic.ppo_micro_batch_size_per_gpu=32", "ref.log_prob_micro_batch_size_per_gpu=32"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--setups", default="grpo,ppo", help=f"comma-separated, from {','.join(SETUPS)}")
    p.add_argument("--quick", action="store_true", help="3 steps of GRPO only")
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "sections" / "phases.json")
    args = p.parse_args(argv)
    steps = 3 if args.quick else args.steps
    setups = ["grpo"] if args.quick else [s for s in args.setups.split(",") if s]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        raise SystemExit(f"--setups: unknown {unknown}; known: {list(SETUPS)}")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="megarl-bench-phases-"))
    task = prepare_task(work)
    runs: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name in setups:
        run_dir = work / f"phases_{name}"
        try:
            run = run_megarl(run_dir, base_overrides(task, run_dir, steps) + SETUPS[name],
                             prompts=PROMPTS, n=N, timeout_s=args.timeout)
        except RuntimeError as err:  # one failing setup must not hide the others
            errors[name] = str(err)[-2000:]
            continue
        s = run["summary"]
        runs[name] = {
            "overrides": SETUPS[name],
            "step_s_mean": s["step_s_mean"],
            "phase_seconds_mean": s["phase_seconds_mean"],
            "phase_shares": s["phase_shares"],
            "biggest_phase": s["biggest_phase"],
            "timed_steps": s["timed_steps"],
            "load_average_before": run["load_average_before"],
            "load_average_after": run["load_average_after"],
            "records": run["records"],
        }
    result = {"section": "phases", "machine": machine_info(), "steps": steps, "runs": runs, "errors": errors,
              "load_average_end": load_average()}
    write_json(args.out, result)
    print(json.dumps({k: {"biggest": v["biggest_phase"], "shares": v["phase_shares"]} for k, v in runs.items()},
                     indent=2))
    return 1 if errors and not runs else 0


if __name__ == "__main__":
    raise SystemExit(main())
