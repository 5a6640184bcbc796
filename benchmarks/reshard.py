"""Weight sync (reshard) cost: time and bytes of one sync for several layouts and model sizes,
against the floor of a plain memory copy of the same bytes on this machine.

Two gloo processes run the real plan and executor (point-to-point sends in bounded buckets) for
each layout: TP2 -> rollout TP1, PP2 -> TP1, TP1 x DP2 -> TP2 and TP2 -> TP2 (vLLM's per-rank
layout), on random Qwen2-shaped models of about 10M, 50M and 100M parameters (float32).

    python benchmarks/reshard.py [--sizes 10M,50M,100M] [--repeats 5] [--out benchmarks/results/reshard.json]

The sync writes into preallocated engine parameters (as the in-place vLLM delivery does).
Printed per case: bytes received by all ranks and the minimum any plan must move (bytes of each
rollout shard not already held); the sync time (slowest rank, median of repeats); the floor
(`Tensor.copy_` of each rank's rollout shard bytes, measured in the same processes right after the
sync, slowest rank) and sync/floor; the transport's own cost (one plain gloo send/receive of the
same bytes in one buffer) and sync/p2p.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "distributed"))

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "reshard.json"

SIZES: dict[str, dict[str, int]] = {
    "10M": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=8192),
    "50M": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=16384),
    "100M": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=10, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=16384),
}
# name -> (train layout, rollout tp)
LAYOUTS: dict[str, tuple[dict[str, int], int]] = {
    "tp2->tp1": (dict(tp=2), 1),
    "pp2->tp1": (dict(pp=2), 1),
    "tp1dp2->tp2": (dict(dp=2), 2),
    "tp2->tp2": (dict(tp=2), 2),
}


def hf_config(size: str) -> dict[str, Any]:
    return dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu",
                max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, **SIZES[size])


def _worker(rank: int, world: int, port: int, cases: list[tuple[str, str]], shapes: dict[str, dict],
            bucket_bytes: int, repeats: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from megarl.hybrid.executor import execute_plan
    from megarl.hybrid.plan import build_reshard_plan
    from megarl.layout import ParallelLayout
    from megarl.models.spec import ModelSpec

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = []
    for size, layout in cases:
        train_kw, rollout_tp = LAYOUTS[layout]
        spec = ModelSpec.from_hf_config(hf_config(size))
        train = ParallelLayout(**{"dp": 1, **train_kw})
        t0 = time.perf_counter()
        rollout = ParallelLayout.rollout(rollout_tp, world)
        plan = build_reshard_plan(spec, train, rollout, "hf" if rollout_tp == 1 else "vllm",
                                  torch.float32, bucket_bytes, hf_shapes=shapes[size])
        plan_seconds = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(rank)
        shards = {t.name: torch.randn(t.shape, generator=gen) for t in plan.train_tensors[rank]}
        # Engine parameters preallocated, as when the sync writes into the rollout engine in place.
        engine = {t.name: torch.empty(t.shape) for t in plan.engine_tensors[rank]}
        seconds = []
        for _ in range(repeats + 1):  # the first run warms up buffers and connections
            dist.barrier()
            t0 = time.perf_counter()
            _, stats = execute_plan(plan, shards, out=engine)
            dist.barrier()
            seconds.append(time.perf_counter() - t0)
        out.append(dict(size=size, layout=layout, plan_seconds=plan_seconds, seconds=seconds[1:],
                        p2p_seconds=_p2p_floor(rank, stats.bytes_received, stats.bytes_sent, repeats),
                        floor_seconds=copy_floor(plan.bytes[rank].needed, repeats),
                        stats=stats.as_dict(), needed=plan.bytes[rank].needed, buckets=stats.buckets_received))
    return out


def _p2p_floor(rank: int, nbytes_in: int, nbytes_out: int, repeats: int) -> float:
    """Median seconds of one plain gloo exchange of the same bytes in one buffer each way (2 ranks):
    the transport's own cost, for comparison with the bucketed sync."""
    import torch.distributed as dist

    if nbytes_in == 0 and nbytes_out == 0:
        return 0.0
    peer = 1 - rank
    send, recv = torch.randn(max(nbytes_out // 4, 1)), torch.empty(max(nbytes_in // 4, 1))
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        reqs = [dist.irecv(recv, src=peer), dist.isend(send, dst=peer)]
        for req in reqs:
            req.wait()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_floor(nbytes: int, repeats: int) -> float:
    """Median seconds of one `Tensor.copy_` of `nbytes` between two preallocated float32 buffers."""
    src = torch.randn(max(nbytes // 4, 1))
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(max(repeats, 3)):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from _launch import run_distributed

    from megarl.hybrid.slices import hf_tensor_shapes
    from megarl.models.spec import ModelSpec

    sizes = args.sizes.split(",")
    for s in sizes:
        if s not in SIZES:
            raise SystemExit(f"--sizes: unknown size {s!r}; valid: {','.join(SIZES)}")
    shapes = {s: hf_tensor_shapes(ModelSpec.from_hf_config(hf_config(s))) for s in sizes}
    params = {s: sum(int(torch.Size(v).numel()) for v in shapes[s].values()) for s in sizes}
    cases = [(s, layout) for s in sizes for layout in LAYOUTS]
    per_rank = run_distributed(_worker, 2, cases, shapes, args.bucket_mib * 2**20, args.repeats, timeout=900)
    rows = []
    print(f"{'size':>5} {'layout':>12} {'moved MiB':>10} {'min MiB':>9} {'moved/min':>9} {'buckets':>7} "
          f"{'sync s':>8} {'floor s':>8} {'sync/floor':>10} {'p2p s':>8} {'sync/p2p':>8}")
    for i, (size, layout) in enumerate(cases):
        ranks = [r[i] for r in per_rank]
        moved = sum(r["stats"]["bytes_received"] for r in ranks)
        minimum = sum(r["stats"]["minimum_bytes"] for r in ranks)
        sync = statistics.median(max(r["seconds"][k] for r in ranks) for k in range(args.repeats))
        floor_bytes = max(r["needed"] for r in ranks)
        floor = max(r["floor_seconds"] for r in ranks)
        row = dict(size=size, params=params[size], layout=layout, bytes_moved=moved, bytes_minimum=minimum,
                   moved_over_minimum=(moved / minimum) if minimum else 1.0, floor_bytes=floor_bytes,
                   sync_seconds=sync, floor_seconds=floor, sync_over_floor=sync / floor,
                   plan_seconds=max(r["plan_seconds"] for r in ranks),
                   p2p_seconds=max(r["p2p_seconds"] for r in ranks),
                   buckets=sum(r["buckets"] for r in ranks), per_rank=[r["stats"] for r in ranks])
        rows.append(row)
        print(f"{size:>5} {layout:>12} {moved / 2**20:10.1f} {minimum / 2**20:9.1f} {row['moved_over_minimum']:9.2f} "
              f"{row['buckets']:7d} {sync:8.4f} {floor:8.4f} {row['sync_over_floor']:10.1f} "
              f"{row['p2p_seconds']:8.4f} {_ratio(sync, row['p2p_seconds']):>8}")
    return dict(benchmark="reshard", processes=2, backend="gloo", dtype="float32", bucket_mib=args.bucket_mib,
                repeats=args.repeats, torch=torch.__version__, platform=platform.platform(),
                cpus=os.cpu_count(), results=rows)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10M,50M,100M", help=f"comma-separated, from {','.join(SIZES)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mib", type=int, default=16, help="bucket bound per pair of ranks and step")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = parse_args(argv)
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
