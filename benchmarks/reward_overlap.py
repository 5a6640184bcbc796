"""Scoring beside the first forward pass (`reward.overlap`) against scoring before it.

PPO on the quickstart task (actor, reference through the KL loss, critic; the old-log-prob pass
runs) with a user reward function that waits `--latency-ms` per call, standing in for a judge
behind a network call (rule scorers cost ~3 ms a batch here, too little to show anything). The two
settings run alternately, `--rounds` times each, same seed; the step time, the reward phase and
the old-log-prob phase (the pass the scoring runs beside) are averaged over the steps after the
first. The saving can be at most the shorter of the two: the reward phase and the pass.

    python benchmarks/reward_overlap.py [--steps 6] [--rounds 3] [--latency-ms 20] [--size 25m|quickstart]
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


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    time.sleep({latency_s})  # a judge behind a network call
    return float(solution_str.strip().startswith(str(ground_truth)))
"""
PROMPTS, N = 8, 4
# The quickstart's model (2.4M parameters), or a ~25M Qwen2 whose forward passes take long enough
# to hide a reward phase behind (hidden 512, 8 layers, intermediate 1536, 8/4 heads).
SIZES = {
    "quickstart": [],
    "25m": ["model.hf_config.hidden_size=512", "model.hf_config.intermediate_size=1536",
            "model.hf_config.num_hidden_layers=8", "model.hf_config.num_attention_heads=8",
            "model.hf_config.num_key_value_heads=4"],
}
PPO = [
    "algorithm.adv_estimator=gae", "algorithm.lam=0.95", f"rollout.n={N}", f"data.train_batch_size={PROMPTS}",
    "actor.use_kl_loss=true", "actor.kl_loss_coef=0.01", "actor.old_log_prob_source=recompute",
    "critic.ppo_mini_batch_size=8", "critic.ppo_micro_batch_size_per_gpu=8", "reward.num_workers=2",
]


def scoring_and_first_pass_s(phase_seconds: dict[str, float], overlapped: bool) -> float:
    """Wall time of the scoring and the old-log-prob pass together: with the overlap the scoring runs
    inside the pass's phase, before it they are two phases. The rest of the step is the same work
    in both settings, so this is where the saving shows (the step time also carries the machine's
    noise)."""
    return phase_seconds["old_log_prob"] + (0.0 if overlapped else phase_seconds["reward"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--size", choices=sorted(SIZES), default="25m")
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
                overrides = base_overrides(task, run_dir, args.steps) + PPO + SIZES[args.size] + [
                    f"reward.custom_reward_function.path={reward_file}",
                    f"reward.overlap={'true' if name == 'overlap' else 'false'}"]
                result = run_megarl(run_dir, overrides, prompts=PROMPTS, n=N, timeout_s=1800)
                summary = result["summary"]
                seconds = summary["phase_seconds_mean"]
                runs[name].append({"step_s": summary["step_s_mean"], "reward_s": seconds.get("reward"),
                                   "old_log_prob_s": seconds.get("old_log_prob"),
                                   "reward_last": summary["reward_last_window_mean"],
                                   "scoring_and_first_pass_s": scoring_and_first_pass_s(seconds, name == "overlap"),
                                   "phase_seconds": seconds, "load_average": load_average()})
                print(f"round {round_index + 1}/{args.rounds} {name:8s} step {summary['step_s_mean']:.3f} s, "
                      f"reward phase {seconds.get('reward', 0):.3f} s, old log-prob {seconds.get('old_log_prob', 0):.3f} s",
                      flush=True)
    averages = {name: {key: mean([r[key] for r in rows]) for key in ("step_s", "reward_s", "old_log_prob_s", "scoring_and_first_pass_s", "reward_last")}
                for name, rows in runs.items()}
    ratio = averages["overlap"]["step_s"] / averages["before"]["step_s"]
    saved = averages["before"]["step_s"] - averages["overlap"]["step_s"]
    bound = min(averages["before"]["reward_s"], averages["before"]["old_log_prob_s"])
    both = {name: averages[name]["scoring_and_first_pass_s"] for name in averages}
    print(f"scoring + old-log-prob pass: {both['overlap']:.3f} s with the overlap, {both['before']:.3f} s before "
          f"(at most {bound:.3f} s can be saved); step time overlap/before {ratio:.3f}")
    write_json(args.out, {
        "benchmark": "reward_overlap", "machine": machine_info(), "load_average_before": load_before,
        "load_average_after": load_average(), "command": "python benchmarks/reward_overlap.py "
        f"--steps {args.steps} --rounds {args.rounds} --latency-ms {args.latency_ms:g} --size {args.size}",
        "settings": {"size": args.size, "size_overrides": SIZES[args.size], "prompts": PROMPTS, "n": N, "steps": args.steps, "rounds": args.rounds,
                     "latency_ms_per_call": args.latency_ms, "overrides": PPO},
        "runs": runs, "averages": averages, "step_time_ratio_overlap_over_before": ratio,
        "seconds_saved_per_step": saved, "most_that_can_be_saved_s": bound,
        "scoring_and_first_pass_s": both,
    })


if __name__ == "__main__":
    main()
