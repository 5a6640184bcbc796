"""Data-parallel gradient sums on CPU, side by side in one run: gloo's all-reduce against
`megarl.megatron.host_reduce.HostSumReducer` (shared memory), on the same gloo processes of one
host, one thread each (as megarl's CPU workers run).

For each size (fp32 elements: the quickstart model's 2.37M parameters, the 25M model's) the two
alternate call by call after a warm-up, every call behind a barrier; the median and fastest of
`--repeats` calls of each, in milliseconds, on the slowest rank, and gloo / shared memory. The
bytes each moves are the same, so the ratio is the speed-up of that part of an update. Each way
sums the gradients as Megatron's DDP hands them over, scaled by 1/ranks first: gloo after a scaling
pass, the shared memory one with the scaling in its copy-in (`HostSumReducer(t, scale=...)`), and
beside it the same with a separate scaling pass (`shared_memory_scale_pass`, how it ran before).

    python benchmarks/host_reduce.py [--sizes 2368000,25191424] [--ranks 2] [--repeats 30]

Prints a table and writes JSON to --out (default benchmarks/results/host_reduce.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, ratio, write_json  # noqa: E402

from megarl.megatron.host_reduce import DEFAULT_CHUNK_BYTES, HostSumReducer  # noqa: E402

DEFAULT_SIZES = (2_368_000, 25_191_424)  # parameters of the e2e benchmark's two models


def _rank(rank: int, world: int, port: int, sizes: list[int], repeats: int, chunk_bytes: int, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    reducer = HostSumReducer(None, chunk_bytes=chunk_bytes)
    results = []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        scale = 1 / world  # Megatron's gradient_scaling_factor for a sum over the data-parallel ranks

        def gloo(t: torch.Tensor) -> None:
            t *= scale
            dist.all_reduce(t)

        def scale_pass(t: torch.Tensor) -> None:
            t *= scale
            reducer(t)

        ways = {"gloo": gloo, "shared_memory": lambda t: reducer(t, scale=scale), "shared_memory_scale_pass": scale_pass}
        for fn in ways.values():  # warm-up: pages touched, sockets and caches primed
            fn(x.clone())
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(repeats):
            for name, fn in ways.items():
                t = x.clone()
                dist.barrier()
                start = time.perf_counter()
                fn(t)
                seconds[name].append(time.perf_counter() - start)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, seconds)
        if rank == 0:
            slowest = {name: [max(r[name][i] for r in gathered) for i in range(repeats)] for name in ways}
            results.append({"elements": n, "megabytes": n * 4 / 1e6, **{
                name: {"median_ms": 1e3 * statistics.median(v), "fastest_ms": 1e3 * min(v)}
                for name, v in slowest.items()}})
    reducer.close()
    dist.destroy_process_group()
    if rank == 0:
        out.put(results)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="fp32 elements, comma-separated")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / 2**20,
                   help="MiB of a tensor per round (the reducer's chunk_bytes)")
    p.add_argument("--port", type=int, default=29561)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "host_reduce.json")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    chunk_bytes = int(args.chunk_mb * 2**20)
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, args.port, sizes, args.repeats, chunk_bytes, queue))
             for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    results = queue.get(timeout=1800)
    for proc in procs:
        proc.join()
    for row in results:
        row["gloo_over_shared_memory_median"] = ratio(row["gloo"]["median_ms"], row["shared_memory"]["median_ms"])
        row["gloo_over_shared_memory_fastest"] = ratio(row["gloo"]["fastest_ms"], row["shared_memory"]["fastest_ms"])
        row["scale_pass_over_scale_in_copy_median"] = ratio(row["shared_memory_scale_pass"]["median_ms"],
                                                            row["shared_memory"]["median_ms"])
    payload = {"section": "host_reduce", "machine": machine_info(), "ranks": args.ranks, "repeats": args.repeats,
               "threads_per_rank": 1, "chunk_bytes": chunk_bytes, "results": results}
    print(f"{'MB':>8} {'gloo median':>12} {'shm median':>11} {'ratio':>6} {'gloo fastest':>13} {'shm fastest':>12} "
          f"{'shm + scaling pass':>19} {'ratio':>6}")
    for row in results:
        print(f"{row['megabytes']:8.1f} {row['gloo']['median_ms']:12.2f} {row['shared_memory']['median_ms']:11.2f} "
              f"{row['gloo_over_shared_memory_median']:6.2f} {row['gloo']['fastest_ms']:13.2f} "
              f"{row['shared_memory']['fastest_ms']:12.2f} {row['shared_memory_scale_pass']['median_ms']:19.2f} "
              f"{row['scale_pass_over_scale_in_copy_median']:6.2f}")
    print(f"wrote {write_json(args.out, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
