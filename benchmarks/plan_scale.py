"""Cost of planning one rank's weight sync as the world grows: the per-rank planner
(`megarl.hybrid.rank_plan`) on a Qwen2.5-72B shape (no weights: shapes only), trained at
TP8 x PP4 x DP2 (64 ranks), TP8 x PP8 x DP4 (256) and TP8 x PP8 x DP16 (1,024), synced into vLLM
at TP8 in bf16.

For each layout a sample of ranks (first, middle, last) is planned from scratch, each in a fresh
planner: time of building the world-independent tables plus planning the rank (fastest of
`--repeats`, since the machine may be shared), and its peak
Python memory (tracemalloc, a separate run so that tracing does not slow the timed one). Each
sampled rank must receive exactly its minimum (bytes it needs that its training shard lacks).
With `--world-check` (default up to 256 ranks) the receiving half of every rank is planned too
(tables shared) and the world's total must equal the sum of the minima. With `--compare-full`
(default up to 64 ranks) the whole-world planner (`build_reshard_plan`, which every rank runs
today) is timed on the same layout. The HF shapes come from a meta-device model once
(`shapes_seconds`, also independent of the world size).

    python benchmarks/plan_scale.py [--layouts 8x4x2,8x8x4,8x8x16] [--out benchmarks/results/plan_scale.json]
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402

from megarl.hybrid.plan import build_reshard_plan  # noqa: E402
from megarl.hybrid.rank_plan import RankPlanner  # noqa: E402
from megarl.hybrid.slices import hf_tensor_shapes  # noqa: E402
from megarl.layout import ParallelLayout  # noqa: E402
from megarl.models.spec import ModelSpec  # noqa: E402

DEFAULT_OUT = RESULTS_DIR / "plan_scale.json"
# Qwen2.5-72B's config.json (the fields the shapes depend on).
QWEN25_72B = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 8192, "intermediate_size": 29568,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "hidden_act": "silu",
}
GOAL_SECONDS, GOAL_MIB = 5.0, 200.0  # per rank, at 1,024 ranks


def parse_layout(text: str) -> ParallelLayout:
    """"8x4x2" -> TP8 x PP4 x DP2."""
    tp, pp, dp = (int(x) for x in text.split("x"))
    return ParallelLayout(tp=tp, pp=pp, dp=dp)


def plan_one(spec: ModelSpec, train: ParallelLayout, rollout: ParallelLayout, rank: int,
             shapes: dict[str, tuple[int, ...]], bucket_bytes: int, repeats: int) -> dict[str, Any]:
    """Plan `rank` from scratch `repeats` times (the fastest counts: the machine is shared), then
    once more under tracemalloc for its peak memory."""
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        planner = RankPlanner(spec, train, rollout, "vllm", torch.bfloat16, bucket_bytes, hf_shapes=shapes)
        t1 = time.perf_counter()
        plan = planner.plan(rank)
        t2 = time.perf_counter()
        del planner
        if best is None or t2 - t0 < best[2] - best[0]:
            best = (t0, t1, t2)
    t0, t1, t2 = best
    tracemalloc.start()
    RankPlanner(spec, train, rollout, "vllm", torch.bfloat16, bucket_bytes, hf_shapes=shapes).plan(rank)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    b = plan.bytes
    assert b.received == b.minimum, f"rank {rank}: received {b.received} bytes, minimum {b.minimum}"
    return dict(rank=rank, tables_seconds=t1 - t0, plan_seconds=t2 - t1, seconds=t2 - t0,
                peak_mib=peak / 2**20, received=b.received, minimum=b.minimum, sent=b.sent,
                needed=b.needed, steps=len(plan.steps), peers=len({p for s in plan.steps for p in s}))


def world_check(spec: ModelSpec, train: ParallelLayout, rollout: ParallelLayout,
                shapes: dict[str, tuple[int, ...]], bucket_bytes: int) -> dict[str, Any]:
    """Every rank's receiving half (shared tables): total received == sum of the minima."""
    t0 = time.perf_counter()
    planner = RankPlanner(spec, train, rollout, "vllm", torch.bfloat16, bucket_bytes, hf_shapes=shapes)
    received = minimum = 0
    for rank in range(train.world_size):
        counts, _, _ = planner.received(rank)
        received, minimum = received + counts.received, minimum + counts.minimum
    assert received == minimum, f"world receives {received} bytes, minimum {minimum}"
    return dict(received=received, minimum=minimum, seconds=time.perf_counter() - t0)


def full_planner(spec: ModelSpec, train: ParallelLayout, rollout: ParallelLayout,
                 shapes: dict[str, tuple[int, ...]], bucket_bytes: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    plan = build_reshard_plan(spec, train, rollout, "vllm", torch.bfloat16, bucket_bytes, hf_shapes=shapes)
    return dict(seconds=time.perf_counter() - t0, received=plan.total_received(),
                largest_sent=max(b.sent for b in plan.bytes.values()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="8x4x2,8x8x4,8x8x16", help="TPxPPxDP, comma separated")
    parser.add_argument("--rollout-tp", type=int, default=8)
    parser.add_argument("--bucket-mib", type=float, default=64.0)
    parser.add_argument("--world-check", type=int, default=256, help="check every rank's bytes up to this world size")
    parser.add_argument("--compare-full", type=int, default=64, help="time the whole-world planner up to this world size")
    parser.add_argument("--repeats", type=int, default=3, help="timed plans per sampled rank (the fastest counts)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    spec = ModelSpec.from_hf_config(QWEN25_72B)
    t0 = time.perf_counter()
    shapes = hf_tensor_shapes(spec)
    shapes_seconds = time.perf_counter() - t0
    bucket = int(args.bucket_mib * 2**20)
    rows = []
    for text in args.layouts.split(","):
        train = parse_layout(text)
        world = train.world_size
        rollout = ParallelLayout.rollout(args.rollout_tp, world)
        ranks = sorted({0, world // 2 + 3, world - 1})
        sample = [plan_one(spec, train, rollout, r, shapes, bucket, args.repeats) for r in ranks]
        row: dict[str, Any] = dict(layout=f"TP{train.tp}xPP{train.pp}xDP{train.dp}", world_size=world, ranks=sample,
                                   max_seconds=max(s["seconds"] for s in sample),
                                   max_peak_mib=max(s["peak_mib"] for s in sample))
        if world <= args.world_check:
            row["world"] = world_check(spec, train, rollout, shapes, bucket)
        if world <= args.compare_full:
            row["full_planner"] = full_planner(spec, train, rollout, shapes, bucket)
            assert row["full_planner"]["received"] == row.get("world", {}).get("received", row["full_planner"]["received"])
        rows.append(row)
        print(f"{row['layout']:>16} {world:5d} ranks: per rank {row['max_seconds']:.2f} s, peak {row['max_peak_mib']:.1f} MiB"
              + (f"; whole-world planner {row['full_planner']['seconds']:.1f} s" if "full_planner" in row else ""),
              flush=True)

    print(f"\nQwen2.5-72B shape -> vLLM TP{args.rollout_tp}, bf16; HF shapes {shapes_seconds:.2f} s once")
    print(f"{'layout':>16} {'ranks':>5} {'rank':>5} {'tables s':>8} {'plan s':>7} {'peak MiB':>8} "
          f"{'recv GiB':>8} {'min GiB':>8} {'sent GiB':>8} {'peers':>5} {'steps':>5}")
    for row in rows:
        for s in row["ranks"]:
            print(f"{row['layout']:>16} {row['world_size']:5d} {s['rank']:5d} {s['tables_seconds']:8.2f} "
                  f"{s['plan_seconds']:7.2f} {s['peak_mib']:8.1f} {s['received'] / 2**30:8.2f} "
                  f"{s['minimum'] / 2**30:8.2f} {s['sent'] / 2**30:8.2f} {s['peers']:5d} {s['steps']:5d}")
    largest = max(rows, key=lambda r: r["world_size"])
    summary = dict(largest_world=largest["world_size"], per_rank_seconds=largest["max_seconds"],
                   per_rank_peak_mib=largest["max_peak_mib"],
                   goal_met=largest["max_seconds"] < GOAL_SECONDS and largest["max_peak_mib"] < GOAL_MIB,
                   seconds_ratio_largest_over_smallest=largest["max_seconds"] / rows[0]["max_seconds"])
    write_json(args.out, dict(benchmark="plan_scale", model="Qwen2.5-72B (shapes)", rollout_tp=args.rollout_tp,
                              engine="vllm", dtype="bfloat16", bucket_mib=args.bucket_mib,
                              shapes_seconds=shapes_seconds, goal=dict(seconds=GOAL_SECONDS, peak_mib=GOAL_MIB),
                              summary=summary, results=rows, machine=machine_info()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
