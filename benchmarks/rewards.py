"""Reward scoring: built-in scorers in-process vs in isolated workers; user functions on 1 vs N workers.

    python benchmarks/rewards.py [--samples 4096] [--out benchmarks/results/rewards.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from megarl.rewards.manager import RewardManager
from megarl.rewards.pool import ScoringPool
from megarl.rewards.worker import ScoringTarget

USER_FN = '''
import time
def trivial(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)
def busy_1ms(data_source, solution_str, ground_truth, extra_info=None):
    end = time.perf_counter() + 0.001
    while time.perf_counter() < end:
        pass
    return 1.0
'''


def timed(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--out", default="benchmarks/results/rewards.json")
    args = parser.parse_args()
    n, cores = args.samples, os.cpu_count() or 1
    texts = [f"Work... so the answer is $\\boxed{{\\frac{{{i % 7}}}{{{i % 5 + 1}}}}}$." for i in range(n)]
    truths = [f"{i % 7}/{i % 5 + 1}" for i in range(n)]
    sources, mask = ["math"] * n, torch.ones(n, 8)
    results: dict[str, float] = {}

    local = RewardManager()
    results["builtin_in_process_us_per_sample"] = 1e6 * timed(lambda: local.score(texts, truths, sources, None, None, mask)) / n
    with RewardManager(isolate_builtin=True, num_workers=cores) as isolated:
        results["builtin_isolated_us_per_sample"] = 1e6 * timed(lambda: isolated.score(texts, truths, sources, None, None, mask)) / n

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fns.py"
        path.write_text(USER_FN)
        start = time.perf_counter()
        pool = ScoringPool(ScoringTarget(str(path), "trivial"), cores, 10.0)
        results["pool_start_s"] = time.perf_counter() - start
        calls = [("x", t, t, None) for t in truths]
        results["user_trivial_us_per_sample"] = 1e6 * timed(lambda: pool.map(calls)) / n
        start = time.perf_counter()
        pool._replace(pool._workers[0])  # what a timeout or crash costs besides the call itself
        results["worker_restart_s"] = time.perf_counter() - start
        pool.close()
        busy_calls = calls[:512]
        for workers in sorted({1, cores}):
            with ScoringPool(ScoringTarget(str(path), "busy_1ms"), workers, 10.0) as busy:
                results[f"user_busy_1ms_{workers}_workers_s"] = timed(lambda: busy.map(busy_calls), repeats=2)

    results["isolation_overhead_ratio"] = results["builtin_isolated_us_per_sample"] / results["builtin_in_process_us_per_sample"]
    results["busy_speedup_all_cores"] = results["user_busy_1ms_1_workers_s"] / results[f"user_busy_1ms_{cores}_workers_s"]
    results["cores"] = cores
    for key, value in results.items():
        print(f"{key:40s} {value:10.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
