"""Data-parallel gradient sums through shared memory, for CPU ranks that all run on one host.

On CPU, Megatron's DDP sums the gradients of the data-parallel ranks with a gloo all-reduce: over
TCP on the loopback device, with gloo's own threads, 8-9 ms for the quickstart's 9.5 MB on a 2-core
machine (median of 30; `benchmarks/host_reduce.py`). When every rank of the group is a process of
this host, `HostSumReducer` sums through one segment of shared memory instead:

    each rank copies a chunk of its tensor into its own slot (times `scale`, in the same pass)   (barrier)
    rank r adds the slots of its r-th share of the chunk, in rank order, into slot 0   (barrier)
    each rank copies the summed chunk back from slot 0

Two barriers per chunk (gloo's, on the same group: a rank waiting for the others sleeps), and two
sets of slots used in turn, so a rank may start the next chunk while another still copies the last
one out. Every rank adds the same operands in the same order, so all ranks hold the same bits, and
with two ranks the sum is exactly gloo's (a + b is b + a in floating point).

`install_host_grad_reduce` hands Megatron's gradient buckets to it, for plain DDP (not the
distributed optimizer, whose reduce-scatter stays with gloo) with synchronous gradient reduction.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.errors import MegarlError

logger = logging.getLogger(__name__)

# Bytes of a tensor per round: each round costs two barriers, and the segment holds 2 x ranks x this.
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024


class HostReduceUnavailable(MegarlError, RuntimeError):
    """Shared memory for the reducer could not be set up here (no room, no writable directory)."""


def shared_memory_dir() -> Path:
    """Where the segment's file lives: /dev/shm when it is a writable directory, else the temp dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def host_identity() -> str:
    """This host's name and boot id: two processes with the same one share its memory."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def group_on_one_host(group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of `group` runs on this rank's host (a collective of the group)."""
    ids: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(ids, host_identity(), group=group)
    return len(set(ids)) == 1


class HostSumReducer:
    """In-place sum of a tensor over the ranks of `group`, through shared memory (see the module).

    Collective to build (every rank of the group, together): group rank 0 creates the segment,
    the others map it, then rank 0 removes its name, so nothing is left behind when the processes
    end, however they end. Raises `HostReduceUnavailable` on every rank when any rank could not set
    it up. `dtype`: the element type of the tensors it sums; `chunk_bytes`: bytes of a tensor moved
    per round (the segment holds 2 x ranks x that).
    """

    def __init__(self, group: dist.ProcessGroup | None, dtype: torch.dtype = torch.float32,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, directory: Path | None = None) -> None:
        self.group = group
        self.dtype = dtype
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.chunk = max(self.world, chunk_bytes // itemsize)
        nbytes = 2 * self.world * self.chunk * itemsize
        src = dist.get_global_rank(group, 0) if group is not None else 0
        directory = Path(directory) if directory is not None else shared_memory_dir()
        path: list[Any] = [None]
        error = ""
        fd = -1
        if self.rank == 0:
            name: str | None = None
            try:
                fd, name = tempfile.mkstemp(prefix="megarl_grad_reduce_", dir=directory)
                os.posix_fallocate(fd, 0, nbytes)  # fails now on a full tmpfs, not with SIGBUS later
                path[0] = name
            except OSError as exc:
                error = f"rank 0 could not reserve {nbytes} bytes under {directory}: {exc}"
                # Removed at once and not sent: the others would map a file shorter than the
                # segment (mmap raises ValueError), and a rank that fails before the gather would
                # leave the name behind.
                if fd >= 0:
                    os.close(fd)
                    fd = -1
                if name is not None:
                    with contextlib.suppress(OSError):  # rank 0 must still reach the broadcast
                        os.unlink(name)
        self._map = None
        try:
            dist.broadcast_object_list(path, src=src, group=group)
            if path[0] is not None:  # no path: rank 0 failed, and says so below
                try:
                    if self.rank != 0:
                        fd = os.open(path[0], os.O_RDWR)
                    self._map = mmap.mmap(fd, nbytes)
                except (OSError, ValueError) as exc:  # ValueError: a file shorter than the segment
                    error = f"rank {self.rank} could not map {nbytes} bytes of {path[0]}: {exc}"
                finally:
                    if fd >= 0:
                        os.close(fd)
            errors: list[Any] = [None] * self.world
            dist.all_gather_object(errors, error, group=group)  # every rank has mapped it, or gives up
        finally:
            # Every rank that could has mapped it by now, and one that raised is not coming back for
            # it: the name goes however this ended.
            if self.rank == 0 and path[0] is not None:
                os.unlink(path[0])
        failed = [e for e in errors if e]
        if failed:
            self.close()
            raise HostReduceUnavailable("shared-memory gradient reduction unavailable: " + "; ".join(failed))
        self.slots = torch.frombuffer(self._map, dtype=dtype).view(2, self.world, self.chunk)
        self._parity = 0

    def __call__(self, tensor: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Sum `tensor` (contiguous, of the reducer's dtype) times `scale` over the ranks, in place;
        returns it. Each rank's product is rounded as `tensor *= scale` rounds it, before the sum."""
        if tensor.dtype != self.dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"host reduce: needs a contiguous CPU {self.dtype} tensor, got {tensor.dtype} "
                             f"on {tensor.device} (contiguous: {tensor.is_contiguous()})")
        flat = tensor.view(-1)
        for lo in range(0, flat.numel(), self.chunk):
            part = flat[lo:lo + self.chunk]
            n = part.numel()
            slots = self.slots[self._parity]
            if scale == 1.0:
                slots[self.rank, :n].copy_(part)
            else:  # one pass over the chunk instead of a scaling pass and a copy
                torch.mul(part, scale, out=slots[self.rank, :n])
            dist.barrier(group=self.group)
            share = -(-n // self.world)
            a, b = min(n, self.rank * share), min(n, (self.rank + 1) * share)
            total = slots[0, a:b]
            for r in range(1, self.world):
                total.add_(slots[r, a:b])
            dist.barrier(group=self.group)
            part.copy_(slots[0, :n])
            self._parity ^= 1
        return tensor

    def close(self) -> None:
        self.slots = None
        if self._map is not None:
            self._map.close()
            self._map = None


def install_host_grad_reduce(ddp: Any) -> int:
    """Sum the gradient buckets of Megatron DDP `ddp` with `HostSumReducer` where that applies:
    plain DDP (no distributed optimizer), synchronous reduction, a sum (not an average in the
    collective), CPU gradient buffers, data-parallel groups of more than one rank on one host.
    Collective over each data-parallel group. Returns the bucket groups handed over (0: none)."""
    cfg = ddp.ddp_config
    if cfg.use_distributed_optimizer or cfg.overlap_grad_reduce or cfg.average_in_collective:
        return 0
    if cfg.check_for_nan_in_grad or cfg.check_for_large_grads or cfg.num_distributed_optimizer_instances != 1:
        return 0
    reducers: dict[tuple[int, torch.dtype], HostSumReducer | None] = {}
    installed = 0
    for bucket_group in [*ddp.bucket_groups, *ddp.expert_parallel_bucket_groups]:
        group = bucket_group.data_parallel_group
        if dist.get_world_size(group) == 1:
            continue
        buffers = [bucket.grad_data for bucket in bucket_group.buckets]
        if any(b.device.type != "cpu" for b in buffers) or len({b.dtype for b in buffers}) != 1:
            continue
        key = (id(group), buffers[0].dtype)
        if key not in reducers:  # every rank meets the same groups in the same order
            reducers[key] = None
            if group_on_one_host(group):
                largest = max(b.numel() * b.element_size() for b in buffers)
                try:  # one round for a bucket that fits (the quickstart's 9.5 MB), no more memory than it needs
                    reducers[key] = HostSumReducer(group, dtype=buffers[0].dtype,
                                                   chunk_bytes=min(DEFAULT_CHUNK_BYTES, largest))
                except HostReduceUnavailable as exc:
                    logger.warning("%s; the gradients are summed with gloo", exc)
        reducer = reducers[key]
        if reducer is None:
            continue
        bucket_group.start_grad_sync = _host_grad_sync(bucket_group, reducer)
        installed += 1
    return installed


def _host_grad_sync(bucket_group: Any, reducer: HostSumReducer) -> Any:
    """What Megatron's `start_grad_sync` does for synchronous plain DDP, the sum by `reducer`."""

    def start_grad_sync(force_all_reduce: bool | None = False) -> None:
        for bucket in bucket_group.buckets:
            reducer(bucket.grad_data, scale=bucket.gradient_scaling_factor)
        bucket_group.grad_reduce_handle = None

    return start_grad_sync
