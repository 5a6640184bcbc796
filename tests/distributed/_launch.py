"""Run a function on N local processes joined in one gloo group; collect results or failures.

Never hangs: the parent waits at most `timeout` seconds, then kills every child and fails.

The processes are forked from a fork server that imported torch, Megatron-Core and transformers
once for the whole test run: a spawned process spent 3-6 s of CPU on those imports on a 2-core
machine, and the distributed tier starts about 75 worlds of 2-4 processes (13.5 min in all there
when spawned, 2.6 min forked). The fork server forks before any process group, thread pool or model
exists, and each child still sets up everything of its own. With CUDA the ranks are spawned.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free a moment ago (all bound at once, then released), for a test
    that forms one process group after another: a port derived from another (port + 1) may be in
    use by any process of the machine."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


if torch.cuda.is_available():
    # The preloaded imports initialise CUDA in the fork server, and a process forked after that
    # cannot use CUDA: GPU tests spawn each rank instead.
    _CONTEXT = mp.get_context("spawn")
else:
    # Imported once in the fork server (the engine brings torch, torch.distributed and Megatron-Core);
    # a module that fails to import there is imported by the child.
    _CONTEXT = mp.get_context("forkserver")
    _CONTEXT.set_forkserver_preload(["megarl.megatron.engine", "transformers"])


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    try:
        import warnings

        warnings.filterwarnings("ignore")
        from megarl.megatron.parallel import destroy_distributed

        try:
            # Plain pickle copies tensor data: the queue's shared-memory handles would die with us.
            results.put((rank, "ok", pickle.dumps(fn(rank, world, port, *args))))
        finally:
            destroy_distributed()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """fn(rank, world_size, master_port, *args) on `world_size` processes; returns results by rank.

    `fn` must be importable (module level). It initialises its own process groups (so it can try
    several layouts in one launch); the launcher tears them down.
    """
    # Not daemonic: Megatron's checkpoint writer starts helper processes of its own.
    results = _CONTEXT.Queue()
    port = free_port()
    procs = [_CONTEXT.Process(target=_worker, args=(r, world_size, port, fn, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, tuple[str, Any]] = {}
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(collected) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"distributed test timed out after {timeout:.0f}s; ranks done: {sorted(collected)}")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in collected]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]}")
                continue
            collected[rank] = (status, value)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=5 if len(collected) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [pickle.loads(collected[r][1]) for r in range(world_size)]
