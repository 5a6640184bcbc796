"""Cost of weight-sync verification: the same reshard with and without fingerprint checks.

Two gloo processes run the real plan and executor (as benchmarks/reshard.py) for each layout and
model size, alternating a sync without verification and one with it (`execute_plan(verify=...)`),
so that both see the same machine state. Printed per case: the median sync time of each (slowest
rank), the overhead of verification ((verified - plain) / plain) from the medians and from the
fastest runs (less sensitive to other processes on the machine), and the time the verified sync
spent comparing fingerprints after the transfers (`ExecStats.verify_seconds`; taking them is fused
with the copies, so its cost shows only in the difference).

    python benchmarks/sync_verify.py [--sizes 10M,50M,100M] [--repeats 7] [--out benchmarks/results/sync_verify.json]
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from reshard import LAYOUTS, SIZES, hf_config  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "sync_verify.json"
CASE_LAYOUTS = ("tp2->tp1", "tp2->tp2")  # every byte of the model moves / nothing moves


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
        plan = build_reshard_plan(spec, train, ParallelLayout.rollout(rollout_tp, world),
                                  "hf" if rollout_tp == 1 else "vllm", torch.float32, bucket_bytes,
                                  hf_shapes=shapes[size])
        gen = torch.Generator().manual_seed(rank)
        shards = {t.name: torch.randn(t.shape, generator=gen) for t in plan.train_tensors[rank]}
        engine = {t.name: torch.empty(t.shape) for t in plan.engine_tensors[rank]}
        timings: dict[bool, list[float]] = {False: [], True: []}
        verify_seconds: list[float] = []
        for k in range(repeats + 1):  # the first pair warms up buffers and connections
            for verify in (False, True):
                dist.barrier()
                t0 = time.perf_counter()
                _, stats = execute_plan(plan, shards, out=engine, verify=verify)
                dist.barrier()
                if k > 0:
                    timings[verify].append(time.perf_counter() - t0)
                    if verify:
                        verify_seconds.append(stats.verify_seconds)
        out.append(dict(size=size, layout=layout, plain=timings[False], verified=timings[True],
                        verify_seconds=verify_seconds, bytes_received=stats.bytes_received,
                        bytes_sent=stats.bytes_sent, pieces=stats.pieces_verified, buckets=stats.buckets_received))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from _launch import run_distributed

    from megarl.hybrid.slices import hf_tensor_shapes
    from megarl.models.spec import ModelSpec

    sizes = args.sizes.split(",")
    for s in sizes:
        if s not in SIZES:
            raise SystemExit(f"--sizes: unknown size {s!r}; valid: {','.join(SIZES)}")
    shapes = {s: hf_tensor_shapes(ModelSpec.from_hf_config(hf_config(s))) for s in sizes}
    cases = [(s, layout) for s in sizes for layout in CASE_LAYOUTS]
    per_rank = run_distributed(_worker, 2, cases, shapes, args.bucket_mib * 2**20, args.repeats, timeout=900)
    rows = []
    print(f"{'size':>5} {'layout':>9} {'moved MiB':>10} {'pieces':>7} {'plain s':>8} {'verified s':>10} "
          f"{'overhead':>8} {'min plain':>9} {'min verif':>9} {'overhead':>8} {'compare s':>9}")
    for i, (size, layout) in enumerate(cases):
        ranks = [r[i] for r in per_rank]
        n = len(ranks[0]["plain"])
        plain = statistics.median(max(r["plain"][k] for r in ranks) for k in range(n))
        verified = statistics.median(max(r["verified"][k] for r in ranks) for k in range(n))
        attributed = statistics.median(max(r["verify_seconds"][k] for r in ranks) for k in range(n))
        plain_min = min(max(r["plain"][k] for r in ranks) for k in range(n))
        verified_min = min(max(r["verified"][k] for r in ranks) for k in range(n))
        moved = sum(r["bytes_received"] for r in ranks)
        row = dict(size=size, layout=layout, bytes_moved=moved, pieces=ranks[0]["pieces"],
                   buckets=sum(r["buckets"] for r in ranks),
                   plain_seconds=plain, verified_seconds=verified, overhead=(verified - plain) / plain,
                   plain_seconds_min=plain_min, verified_seconds_min=verified_min,
                   overhead_min=(verified_min - plain_min) / plain_min,
                   verify_seconds=attributed, verify_share=attributed / verified)
        rows.append(row)
        print(f"{size:>5} {layout:>9} {moved / 2**20:10.1f} {row['pieces']:7d} {plain:8.4f} {verified:10.4f} "
              f"{100 * row['overhead']:7.2f}% {plain_min:9.4f} {verified_min:9.4f} {100 * row['overhead_min']:7.2f}% "
              f"{attributed:9.4f}")
    return dict(benchmark="sync_verify", processes=2, backend="gloo", dtype="float32", bucket_mib=args.bucket_mib,
                repeats=args.repeats, torch=torch.__version__, platform=platform.platform(),
                cpus=os.cpu_count(), results=rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10M,50M,100M", help=f"comma-separated, from {','.join(SIZES)}")
    parser.add_argument("--repeats", type=int, default=7)
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
