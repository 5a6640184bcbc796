"""Throughput of the vectorised advantage estimators (GRPO, GAE, RLOO) against plain Python loops.

The loops are the straightforward per-sample, per-token implementation; they run on a small subset
(``--reference-responses``) and their per-token time is extrapolated to the full batch. The subset
is also used to check that both agree.

    python benchmarks/algorithms.py                       # 262144 responses x 512 tokens
    python benchmarks/algorithms.py --responses 1000000 --estimators grpo,rloo

Prints a table and writes JSON to ``--out`` (default benchmarks/results/algorithms.json).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from megarl.algorithms import AdvantageInputs, AdvantageSettings, get_advantage_estimator

# ----------------------------------------------------------------------------------------------
# Plain-loop references (Python floats, one sample and one token at a time)


def loop_grpo(rewards: list[list[float]], mask: list[list[float]], groups: list[int]) -> list[list[float]]:
    scores = [sum(row) for row in rewards]
    members: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    out = [0.0] * len(scores)
    for idx in members.values():
        vals = [scores[i] for i in idx]
        mean, std = (0.0, 1.0) if len(vals) == 1 else (statistics.fmean(vals), statistics.stdev(vals))
        for i in idx:
            out[i] = (scores[i] - mean) / (std + 1e-6)
    return [[out[i] * m for m in mask[i]] for i in range(len(mask))]


def loop_rloo(rewards: list[list[float]], mask: list[list[float]], groups: list[int]) -> list[list[float]]:
    scores = [sum(row) for row in rewards]
    members: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    out = [0.0] * len(scores)
    for idx in members.values():
        total = sum(scores[i] for i in idx)
        for i in idx:
            out[i] = scores[i] - (total - scores[i]) / (len(idx) - 1) if len(idx) > 1 else scores[i]
    return [[out[i] * m for m in mask[i]] for i in range(len(mask))]


def loop_gae(rewards: list[list[float]], values: list[list[float]], mask: list[list[float]],
             gamma: float = 1.0, lam: float = 0.95) -> list[list[float]]:
    adv = []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        row = [0.0] * len(r_row)
        next_value, last = 0.0, 0.0
        for t in range(len(r_row) - 1, -1, -1):
            if m_row[t]:
                last = r_row[t] + gamma * next_value - v_row[t] + gamma * lam * last
                next_value = v_row[t]
                row[t] = last
        adv.append(row)
    valid = [a for a_row, m_row in zip(adv, mask) for a, m in zip(a_row, m_row) if m]
    mean = sum(valid) / len(valid)
    scale = 1.0 / math.sqrt(sum((a - mean) ** 2 for a in valid) / (len(valid) - 1) + 1e-8)
    return [[(a - mean) * scale if m else 0.0 for a, m in zip(a_row, m_row)] for a_row, m_row in zip(adv, mask)]


# ----------------------------------------------------------------------------------------------


def make_batch(responses: int, length: int, group_size: int, seed: int, values: bool) -> dict[str, torch.Tensor]:
    """Outcome rewards on the last token, variable lengths, groups of ``group_size``; critic values if asked."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (responses,), generator=gen)
    rewards = torch.zeros(responses, length)
    rewards[torch.arange(responses), lengths - 1] = torch.randint(0, 2, (responses,), generator=gen).float()
    batch = {
        "rewards": rewards,
        "mask": (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float(),
        "group_index": torch.arange(responses) // group_size,
    }
    if values:
        batch["values"] = torch.randn(responses, length, generator=gen)
    return batch


def estimate(name: str, batch: dict[str, torch.Tensor],
             settings: AdvantageSettings = AdvantageSettings()) -> torch.Tensor:
    """The advantages of the named estimator on ``batch`` (rewards, mask, group_index, values if any)."""
    inputs = AdvantageInputs(batch["rewards"], batch["mask"], group_index=batch["group_index"],
                             values=batch.get("values"))
    return get_advantage_estimator(name)(inputs, settings)[0]


def best_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--responses", type=int, default=262144, help="responses in the batch")
    parser.add_argument("--length", type=int, default=512, help="response length (tokens)")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    parser.add_argument("--reference-responses", type=int, default=512, help="subset run by the plain loops")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of the vectorised code (best kept)")
    parser.add_argument("--estimators", default="grpo,rloo,gae", help="comma-separated subset of grpo,rloo,gae")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/algorithms.json"))
    args = parser.parse_args()

    chosen = [name.strip() for name in args.estimators.split(",") if name.strip()]
    batch = make_batch(args.responses, args.length, args.group_size, args.seed, values="gae" in chosen)
    n_ref = min(args.reference_responses, args.responses)
    sub = {k: v[:n_ref] for k, v in batch.items()}
    sub_lists = {k: v.double().tolist() for k, v in sub.items() if k != "group_index"}
    sub_groups = sub["group_index"].tolist()

    cases = {
        "grpo": (
            lambda b: estimate("grpo", b),
            lambda: loop_grpo(sub_lists["rewards"], sub_lists["mask"], sub_groups),
        ),
        "rloo": (
            lambda b: estimate("rloo", b),
            lambda: loop_rloo(sub_lists["rewards"], sub_lists["mask"], sub_groups),
        ),
        "gae": (
            lambda b: estimate("gae", b, AdvantageSettings(gamma=1.0, lam=0.95)),
            lambda: loop_gae(sub_lists["rewards"], sub_lists["values"], sub_lists["mask"], gamma=1.0, lam=0.95),
        ),
    }
    unknown = sorted(set(chosen) - set(cases))
    if unknown:
        parser.error(f"--estimators: unknown {unknown}; valid: {sorted(cases)}")
    tokens = args.responses * args.length
    rows = []
    for name in chosen:
        vectorised, loop = cases[name]
        vec_s = best_time(lambda: vectorised(batch), args.repeats)
        start = time.perf_counter()
        expected = loop()
        loop_sub_s = time.perf_counter() - start
        max_abs_diff = float((vectorised(sub).double() - torch.tensor(expected, dtype=torch.float64)).abs().max())
        loop_full_s = loop_sub_s * args.responses / n_ref  # per-token cost extrapolated to the batch
        rows.append({
            "estimator": name,
            "vectorised_s": vec_s,
            "vectorised_responses_per_s": args.responses / vec_s,
            "vectorised_tokens_per_s": tokens / vec_s,
            "loop_subset_responses": n_ref,
            "loop_subset_s": loop_sub_s,
            "loop_extrapolated_s": loop_full_s,
            "loop_tokens_per_s": n_ref * args.length / loop_sub_s,
            "speedup": loop_full_s / vec_s,
            "max_abs_diff_vs_loop": max_abs_diff,
        })

    print(f"{args.responses} responses x {args.length} tokens, groups of {args.group_size}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    header = f"{'estimator':<10}{'vectorised s':>14}{'Mtok/s':>10}{'loop Mtok/s':>13}{'loop s (extrap.)':>18}" \
             f"{'speedup':>10}{'max |diff|':>12}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['estimator']:<10}{r['vectorised_s']:>14.3f}{r['vectorised_tokens_per_s'] / 1e6:>10.1f}"
              f"{r['loop_tokens_per_s'] / 1e6:>13.3f}{r['loop_extrapolated_s']:>18.1f}{r['speedup']:>9.0f}x"
              f"{r['max_abs_diff_vs_loop']:>12.1e}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "algorithms",
        "responses": args.responses,
        "length": args.length,
        "group_size": args.group_size,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "results": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
