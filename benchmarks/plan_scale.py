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
(default up to 64 ranks) the whole-world planner (`build_reshard_plan`, which plans every rank's
pieces on one rank; the weight sync runs the per-rank planner) is timed on the same layout. The HF shapes come from a meta-device model once
(`shapes_seconds`, also independent of the world size).

The same for a Qwen3-235B-A22B shape trained with expert parallelism, TP4 x PP2 x EP8 at DP 8, 32
and 128 (64, 256, 1,024 ranks), twice: into the HF engine at rollout TP 1 (`moe`), where every
rank receives the whole model, so its plan is large (about 145k slices in and as many out) but
should not grow with the world; and into vLLM at rollout TP 8 (`moe_vllm`, `--moe-vllm-tp`), the
realistic case, where each rank receives its rollout TP rank's slice of the attention and of every
expert (written into vLLM's fused expert parameters `w13_weight`/`w2_weight`).

And into vLLM at TP 8 with whole experts (`moe_etp`: expert tensor parallel size 1 while attention
runs at TP4, `--moe-etp-layouts`), where the four TP ranks of a replica hold four different expert
shards.

`--parts` picks what runs (dense, moe, moe_vllm, moe_etp); the parts not run are kept from an existing
`--out` file, each part with the machine it ran on.

    python benchmarks/plan_scale.py [--layouts 8x4x2,8x8x4,8x8x16] [--moe-layouts 4x2x8x8,...]
        [--parts dense,moe,moe_vllm,moe_etp] [--moe-vllm-tp 8] [--moe-etp-layouts 4x2x8x32x1,...]
        [--out benchmarks/results/plan_scale.json]
"""

from __future__ import annotations

import argparse
import json
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
# Qwen3-235B-A22B's config.json: 94 layers, 128 experts (top-8) of width 1536, 4 key/value heads.
QWEN3_235B_A22B = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 1536, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "tie_word_embeddings": False, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
}
GOAL_SECONDS, GOAL_MIB = 5.0, 200.0  # per rank, at 1,024 ranks


def parse_layout(text: str) -> ParallelLayout:
    """"8x4x2" -> TP8 x PP4 x DP2; "4x2x8x8" -> TP4 x PP2 x DP8 x EP8; "4x2x8x32x1" -> ... x EP32 x ETP1."""
    degrees = [int(x) for x in text.split("x")]
    return ParallelLayout(**dict(zip(("tp", "pp", "dp", "ep", "etp"), degrees)))


def plan_one(spec: ModelSpec, train: ParallelLayout, rollout: ParallelLayout, engine: str, rank: int,
             shapes: dict[str, tuple[int, ...]], bucket_bytes: int, repeats: int) -> dict[str, Any]:
    """Plan `rank` from scratch `repeats` times (the fastest counts: the machine is shared), then
    once more under tracemalloc for its peak memory."""
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        planner = RankPlanner(spec, train, rollout, engine, torch.bfloat16, bucket_bytes, hf_shapes=shapes)
        t1 = time.perf_counter()
        plan = planner.plan(rank)
        t2 = time.perf_counter()
        del planner
        if best is None or t2 - t0 < best[2] - best[0]:
            best = (t0, t1, t2)
    t0, t1, t2 = best
    tracemalloc.start()
    RankPlanner(spec, train, rollout, engine, torch.bfloat16, bucket_bytes, hf_shapes=shapes).plan(rank)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    b = plan.bytes[rank]
    assert b.received == b.minimum, f"rank {rank}: received {b.received} bytes, minimum {b.minimum}"
    return dict(rank=rank, tables_seconds=t1 - t0, plan_seconds=t2 - t1, seconds=t2 - t0,
                peak_mib=peak / 2**20, received=b.received, minimum=b.minimum, sent=b.sent,
                needed=b.needed, steps=len(plan.steps), peers=len({p for s in plan.steps for p in s}))


def world_check(spec: ModelSpec, train: ParallelLayout, rollout: ParallelLayout, engine: str,
                shapes: dict[str, tuple[int, ...]], bucket_bytes: int) -> dict[str, Any]:
    """Every rank's receiving half (shared tables): total received == sum of the minima."""
    t0 = time.perf_counter()
    planner = RankPlanner(spec, train, rollout, engine, torch.bfloat16, bucket_bytes, hf_shapes=shapes)
    received = minimum = 0
    for rank in range(train.world_size):
        counts, _, _ = planner.received(rank)
        received, minimum = received + counts.received, minimum + counts.minimum
    assert received == minimum, f"world receives {received} bytes, minimum {minimum}"
    return dict(received=received, minimum=minimum, seconds=time.perf_counter() - t0)


def full_planner(spec: ModelSpec, train: ParallelLayout, rollout: ParallelLayout, engine: str,
                 shapes: dict[str, tuple[int, ...]], bucket_bytes: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    plan = build_reshard_plan(spec, train, rollout, engine, torch.bfloat16, bucket_bytes, hf_shapes=shapes)
    return dict(seconds=time.perf_counter() - t0, received=plan.total_received(),
                largest_sent=max(b.sent for b in plan.bytes.values()))


def scale(model: str, config: dict[str, Any], layouts: str, rollout_tp: int, args: argparse.Namespace,
          ranks_per_layout: int, repeats: int) -> dict[str, Any]:
    """One model at each layout: sampled ranks planned alone, optional world checks."""
    spec = ModelSpec.from_hf_config(config)
    t0 = time.perf_counter()
    shapes = hf_tensor_shapes(spec)
    shapes_seconds = time.perf_counter() - t0
    engine = "hf" if rollout_tp == 1 else "vllm"
    bucket = int(args.bucket_mib * 2**20)
    rows = []
    for text in layouts.split(","):
        train = parse_layout(text)
        world = train.world_size
        rollout = ParallelLayout.rollout(rollout_tp, world)
        ranks = sorted({0, world - 1, world // 2 + 3}) if ranks_per_layout >= 3 else sorted({0, world - 1})
        sample = [plan_one(spec, train, rollout, engine, r, shapes, bucket, repeats) for r in ranks]
        name = (f"TP{train.tp}xPP{train.pp}xDP{train.dp}" + (f"xEP{train.ep}" if train.ep > 1 else "")
                + (f"xETP{train.etp}" if train.etp != train.tp else ""))
        row: dict[str, Any] = dict(layout=name, world_size=world, ranks=sample,
                                   max_seconds=max(s["seconds"] for s in sample),
                                   max_peak_mib=max(s["peak_mib"] for s in sample))
        if world <= args.world_check and not spec.num_experts:
            row["world"] = world_check(spec, train, rollout, engine, shapes, bucket)
        if world <= args.compare_full and not spec.num_experts:
            row["full_planner"] = full_planner(spec, train, rollout, engine, shapes, bucket)
            assert row["full_planner"]["received"] == row.get("world", {}).get("received", row["full_planner"]["received"])
        rows.append(row)
        print(f"{model}: {name:>18} {world:5d} ranks: per rank {row['max_seconds']:.2f} s, peak {row['max_peak_mib']:.1f} MiB"
              + (f"; whole-world planner {row['full_planner']['seconds']:.1f} s" if "full_planner" in row else ""),
              flush=True)
    print(f"\n{model} shape -> {engine} rollout TP{rollout_tp}, bf16; HF shapes {shapes_seconds:.2f} s once")
    print(f"{'layout':>18} {'ranks':>5} {'rank':>5} {'tables s':>8} {'plan s':>7} {'peak MiB':>8} "
          f"{'recv GiB':>8} {'min GiB':>8} {'sent GiB':>8} {'peers':>5} {'steps':>5}")
    for row in rows:
        for s in row["ranks"]:
            print(f"{row['layout']:>18} {row['world_size']:5d} {s['rank']:5d} {s['tables_seconds']:8.2f} "
                  f"{s['plan_seconds']:7.2f} {s['peak_mib']:8.1f} {s['received'] / 2**30:8.2f} "
                  f"{s['minimum'] / 2**30:8.2f} {s['sent'] / 2**30:8.2f} {s['peers']:5d} {s['steps']:5d}")
    print()
    largest = max(rows, key=lambda r: r["world_size"])
    summary = dict(largest_world=largest["world_size"], per_rank_seconds=largest["max_seconds"],
                   per_rank_peak_mib=largest["max_peak_mib"],
                   goal_met=largest["max_seconds"] < GOAL_SECONDS and largest["max_peak_mib"] < GOAL_MIB,
                   seconds_ratio_largest_over_smallest=largest["max_seconds"] / rows[0]["max_seconds"])
    return dict(model=model, rollout_tp=rollout_tp, engine=engine, shapes_seconds=shapes_seconds,
                summary=summary, results=rows)


PARTS = ("dense", "moe", "moe_vllm", "moe_etp")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="8x4x2,8x8x4,8x8x16", help="dense model: TPxPPxDP, comma separated")
    parser.add_argument("--rollout-tp", type=int, default=8)
    parser.add_argument("--moe-layouts", default="4x2x8x8,4x2x32x8,4x2x128x8",
                        help="MoE model: TPxPPxDPxEP, comma separated ('' skips both MoE parts)")
    parser.add_argument("--moe-vllm-tp", type=int, default=8, help="rollout TP of the moe_vllm part (vLLM engine)")
    parser.add_argument("--moe-etp-layouts", default="4x2x8x32x1,4x2x32x32x1,4x2x128x32x1",
                        help="MoE model with expert TP other than TP (moe_etp part): TPxPPxDPxEPxETP")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma separated, of {', '.join(PARTS)}; parts not run are kept from an existing --out")
    parser.add_argument("--bucket-mib", type=float, default=64.0)
    parser.add_argument("--world-check", type=int, default=256, help="check every rank's bytes up to this world size")
    parser.add_argument("--compare-full", type=int, default=64, help="time the whole-world planner up to this world size")
    parser.add_argument("--repeats", type=int, default=3, help="timed plans per sampled rank (the fastest counts)")
    parser.add_argument("--moe-repeats", type=int, default=1, help="timed plans per sampled MoE rank")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or args.moe_vllm_tp < 2:
        parser.error(f"--parts {args.parts!r}: unknown {unknown}; valid: {', '.join(PARTS)}" if unknown
                     else f"--moe-vllm-tp {args.moe_vllm_tp}: the vLLM part needs rollout TP >= 2")
    if not args.moe_layouts:
        parts = [p for p in parts if p == "dense"]

    # What is not run now is kept from the previous results.
    payload: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    if "dense" in parts:
        dense = scale("Qwen2.5-72B", QWEN25_72B, args.layouts, args.rollout_tp, args, 3, args.repeats)
        payload.update(benchmark="plan_scale", model=dense["model"] + " (shapes)", rollout_tp=args.rollout_tp,
                       engine=dense["engine"], dtype="bfloat16", bucket_mib=args.bucket_mib,
                       shapes_seconds=dense["shapes_seconds"], goal=dict(seconds=GOAL_SECONDS, peak_mib=GOAL_MIB),
                       summary=dense["summary"], results=dense["results"], machine=machine_info())
    if "moe" in parts:
        payload["moe"] = {**scale("Qwen3-235B-A22B", QWEN3_235B_A22B, args.moe_layouts, 1, args, 2,
                                  args.moe_repeats), "machine": machine_info()}
    if "moe_vllm" in parts:
        payload["moe_vllm"] = {**scale("Qwen3-235B-A22B", QWEN3_235B_A22B, args.moe_layouts, args.moe_vllm_tp, args,
                                       2, args.moe_repeats), "machine": machine_info()}
    if "moe_etp" in parts:
        payload["moe_etp"] = {**scale("Qwen3-235B-A22B", QWEN3_235B_A22B, args.moe_etp_layouts, args.moe_vllm_tp, args,
                                      2, args.moe_repeats), "machine": machine_info()}
    write_json(args.out, payload)
    print(f"wrote {args.out.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
