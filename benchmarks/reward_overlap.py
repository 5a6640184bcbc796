"""Scoring beside the first forward pass (`reward.overlap`) against scoring before it.

PPO on the quickstart task (actor, reference through the KL loss, critic; the old-log-prob pass
runs) with a user reward function that waits `--latency-ms` per call, standing in for a judge
behind a network call (rule scorers cost ~3 ms a batch here, too little to show anything). The two
settings run alternately, `--rounds` times each, same seed; the step time, the reward phase and
the old-log-prob phase (the pass the scoring runs beside) are averaged over the steps after the
first. The saving can be at most the shorter of the two: the reward phase and the pass.

    python benchmarks/reward_overlap.py [--steps 4] [--rounds 2] [--latency-ms 40]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from common import RESULTS_DIR, load_average, machine_info, mean, write_json
from megarl_run import base_overrides, prepare_task, run_megarl

SLOW_REWARD = """
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({latency_s})  # a judge behind a network call
    return float(solution_str.strip().startswith(str(ground_truth)))
"""
PROMPTS, N = 8, 4
PPO = [
    "algorithm.adv_estimator=gae", "algorithm.lam=0.95", f"rollout.n={N}", f"data.train_batch_size={PROMPTS}",
    "actor.use_kl_loss=true", "actor.kl_loss_coef=0.01", "actor.old_log_prob_source=recompute",
    "critic.ppo_mini_batch_size=8", "critic.ppo_micro_batch_size_per_gpu=8", "reward.num_workers=2",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency-ms", type=float, default=40.0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "reward_overlap.json")
    args = parser.parse_args()
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="megarl-bench-overlap-") as tmp:
        work = Path(tmp)
        task = prepare_task(work)
        reward_file = work / "slow_reward.py"
        reward_file.write_text(SLOW_REWARD.format(latency_s=args.latency_ms / 1000))
        runs: dict[str, list[dict[str, Any]]] = {"overlap": [], "before": []}
        for round_index in range(args.rounds):
            for name in runs:
                run_dir = work / f"{name}-{round_index}"
                overrides = base_overrides(task, run_dir, args.steps) + PPO + [
                    f"reward.custom_reward_function.path={reward_file}",
                    f"reward.overlap={'true' if name == 'overlap' else 'false'}"]
                result = run_megarl(run_dir, overrides, prompts=PROMPTS, n=N, timeout_s=1800)
                summary = result["summary"]
                seconds = summary["phase_seconds_mean"]
                runs[name].append({"step_s": summary["step_s_mean"], "reward_s": seconds.get("reward"),
                                   "old_log_prob_s": seconds.get("old_log_prob"),
                                   "reward_last": summary["reward_last_window_mean"]})
                print(f"round {round_index + 1}/{args.rounds} {name:8s} step {summary['step_s_mean']:.3f} s, "
                      f"reward phase {seconds.get('reward', 0):.3f} s, old log-prob {seconds.get('old_log_prob', 0):.3f} s",
                      flush=True)
    averages = {name: {key: mean([r[key] for r in rows]) for key in rows[0]} for name, rows in runs.items()}
    ratio = averages["overlap"]["step_s"] / averages["before"]["step_s"]
    saved = averages["before"]["step_s"] - averages["overlap"]["step_s"]
    bound = min(averages["before"]["reward_s"], averages["before"]["old_log_prob_s"])
    print(f"step time overlap/before: {ratio:.3f} ({saved:.3f} s saved a step; at most {bound:.3f} s can be)")
    write_json(args.out, {
        "benchmark": "reward_overlap", "machine": machine_info(), "load_average_before": load_before,
        "load_average_after": load_average(), "command": "python benchmarks/reward_overlap.py "
        f"--steps {args.steps} --rounds {args.rounds} --latency-ms {args.latency_ms:g}",
        "settings": {"prompts": PROMPTS, "n": N, "steps": args.steps, "rounds": args.rounds,
                     "latency_ms_per_call": args.latency_ms, "overrides": PPO},
        "runs": runs, "averages": averages, "step_time_ratio_overlap_over_before": ratio,
        "seconds_saved_per_step": saved, "most_that_can_be_saved_s": bound,
    })


if __name__ == "__main__":
    main()
