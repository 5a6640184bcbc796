"""Weights from the training pool to a rollout pool of its own (`resources.rollout_pool`).

With separate placement the rollout engines run in processes of their own, so the generation of
the next batch can overlap the update (`trainer.async_mode`). The rollout pool has as many ranks
as the actor's pool (N); rollout rank r is fed by training rank r:

1. Inside the training world, every training rank reshards the Megatron shards into the rollout
   shard that rollout rank r needs (the hybrid engine's own plan and executor, verified as in the
   colocated sync). This is the only copy of it on the training side, and it is freed after step 2.
2. Over the bridge, a gloo group of 2N ranks that spans both pools (training rank r is bridge rank
   r, rollout rank r is bridge rank N + r), training rank r sends that shard to rollout rank r in
   buckets of at most `bucket_bytes`, each followed by its fingerprint. Rollout rank r compares the
   fingerprints and takes the buckets into its engine: the HF engine's through new tensors handed
   to `update_weights` after the last bucket, vLLM's written straight into its parameters. A
   mismatch stops the sync with an error naming the tensors of the bucket and both ranks (with vLLM
   the changed buckets are then already in the engine: the run stops on it).

So each rollout rank receives exactly the bytes of its own shard: `bytes_received` equals
`minimum_bytes`, since a rollout rank holds nothing of the training weights.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.errors import ConfigError
from megarl.hybrid.executor import ExecStats, execute_plan
from megarl.hybrid.plan import DEFAULT_BUCKET_BYTES
from megarl.hybrid.sync import checked_verify_every, engine_shards, engine_targets, own_plan, verify_due
from megarl.hybrid.slices import vllm_expert_view
from megarl.hybrid.verify import WeightSyncError, fingerprint

_TAG_DATA, _TAG_FINGERPRINT = 0, 1


@dataclass(frozen=True)
class ShardTensor:
    """One tensor of a rollout rank's shard: its engine name and shape (the plan's order), and the
    ranges along `axis` that hold weights (`covered`, (offset, length) each; None: all of it); the
    rest is padding (e.g. vLLM's vocabulary padding), zeroed at the receiver and never sent. A rank
    past the end of a small vocabulary holds only padding (no range)."""

    name: str
    shape: tuple[int, ...]
    axis: int = 0
    covered: Optional[tuple[tuple[int, int], ...]] = None

    @classmethod
    def of(cls, t: Any) -> ShardTensor:
        """From the plan's `LocalTensor` (its blocks merged into ranges)."""
        ranges: list[list[int]] = []
        for lo, n in sorted((b.offset, b.length) for b in t.blocks):
            if ranges and lo <= ranges[-1][0] + ranges[-1][1]:
                ranges[-1][1] = max(ranges[-1][1], lo + n - ranges[-1][0])
            else:
                ranges.append([lo, n])
        shape = tuple(t.shape)
        whole = not shape or [[0, shape[t.axis]]] == ranges
        return cls(t.name, shape, t.axis, None if whole else tuple((lo, n) for lo, n in ranges))

    def ranges(self) -> tuple[tuple[int, int], ...]:
        if self.covered is None:
            return ((0, self.shape[self.axis] if self.shape else 1),)
        return self.covered

    @property
    def row_numel(self) -> int:
        """Elements of one index along `axis`."""
        n = 1
        for i, d in enumerate(self.shape):
            if i != self.axis:
                n *= d
        return n

    @property
    def numel(self) -> int:
        """Elements sent: the covered ranges only."""
        return sum(n for _, n in self.ranges()) * self.row_numel


@dataclass(frozen=True)
class ShardLayout:
    """What rollout rank r receives: its tensors in order, their dtype and the engine layout
    ("hf": full HF-named tensors for `update_weights`; "vllm": vLLM's per-rank parameters)."""

    tensors: tuple[ShardTensor, ...]
    dtype: torch.dtype
    engine_layout: str

    @property
    def nbytes(self) -> int:
        """The bytes sent: the minimum, since a rollout rank holds none of the training weights."""
        return sum(t.numel for t in self.tensors) * torch.empty((), dtype=self.dtype).element_size()

    def regions(self) -> list[tuple[int, int, int]]:
        """(tensor index, offset, length along its axis) of every covered range, in sending order."""
        return [(i, lo, n) for i, t in enumerate(self.tensors) for lo, n in t.ranges()]


def _region(tensor: torch.Tensor, spec: ShardTensor, lo: int, n: int) -> torch.Tensor:
    return tensor.narrow(spec.axis, lo, n) if tensor.dim() else tensor


def _zero_padding(tensor: torch.Tensor, spec: ShardTensor) -> None:
    if spec.covered is None or not tensor.dim():
        return
    start = 0
    for lo, n in list(spec.covered) + [(spec.shape[spec.axis], 0)]:
        if lo > start:
            tensor.narrow(spec.axis, start, lo - start).zero_()
        start = max(start, lo + n)


def open_bridge(host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0) -> dist.ProcessGroup:
    """The gloo group of both pools (bridge rank 0, training rank 0, hosts its store at host:port)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore("megarl-rollout-bridge", store), rank, world_size, timeout)


def _segments(layout: ShardLayout, bucket_numel: int) -> Iterator[list[tuple[int, int, int]]]:
    """Buckets of the covered regions' concatenation: per bucket, (region index, start element,
    elements) in order; a region may be cut anywhere."""
    bucket: list[tuple[int, int, int]] = []
    room = bucket_numel
    for r, (i, _, n) in enumerate(layout.regions()):
        numel, start = n * layout.tensors[i].row_numel, 0
        while start < numel:
            take = min(room, numel - start)
            bucket.append((r, start, take))
            start += take
            room -= take
            if room == 0:
                yield bucket
                bucket, room = [], bucket_numel
    if bucket:
        yield bucket


def _bucket_numel(bucket_bytes: int, dtype: torch.dtype) -> int:
    return max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())


def send_shard(bridge: dist.ProcessGroup, peer: int, tensors: Sequence[torch.Tensor], layout: ShardLayout,
               bucket_bytes: int, verify: bool) -> int:
    """Send the covered regions of `tensors` (in `layout`'s order and shapes) to bridge rank `peer`
    in buckets of at most `bucket_bytes`, each followed by its fingerprint when `verify`; returns
    the bytes sent."""
    regions = [_region(tensors[i], layout.tensors[i], lo, n).reshape(-1) for i, lo, n in layout.regions()]
    numel = _bucket_numel(bucket_bytes, layout.dtype)
    buffer = torch.empty(max(1, min(numel, sum(t.numel for t in layout.tensors))), dtype=layout.dtype)
    sent = 0
    for bucket in _segments(layout, numel):
        n = sum(length for _, _, length in bucket)
        flat, offset = buffer[:n], 0
        for r, lo, length in bucket:
            flat[offset:offset + length].copy_(regions[r][lo:lo + length])
            offset += length
        bridge.send([flat], peer, _TAG_DATA).wait()
        if verify:
            bridge.send([fingerprint(flat).reshape(1)], peer, _TAG_FINGERPRINT).wait()
        sent += n * flat.element_size()
    return sent


def receive_shard(bridge: dist.ProcessGroup, peer: int, targets: Sequence[torch.Tensor], layout: ShardLayout,
                  bucket_bytes: int, verify: bool, rank: int) -> ExecStats:
    """Receive what `send_shard` sends into `targets` (views allowed; padding zeroed); with
    `verify`, every bucket's fingerprint is compared, and after the last one a `WeightSyncError`
    names the tensors (element ranges) of the first bucket that arrived changed, the sending and
    the receiving rank."""
    stats = ExecStats(rank=rank, minimum_bytes=layout.nbytes)
    for target, spec in zip(targets, layout.tensors):
        _zero_padding(target, spec)
    where = layout.regions()
    regions = [_region(targets[i], layout.tensors[i], lo, n) for i, lo, n in where]
    numel = _bucket_numel(bucket_bytes, layout.dtype)
    buffer = torch.empty(max(1, min(numel, sum(t.numel for t in layout.tensors))), dtype=layout.dtype)
    expected = torch.zeros(1, dtype=torch.int64)
    bad: list[str] = []
    for bucket in _segments(layout, numel):
        n = sum(length for _, _, length in bucket)
        flat = buffer[:n]
        bridge.recv([flat], peer, _TAG_DATA).wait()
        if verify:
            bridge.recv([expected], peer, _TAG_FINGERPRINT).wait()
            if int(fingerprint(flat).reshape(())) != int(expected[0]):
                bad.append(", ".join(_describe(layout, where[r], lo, length) for r, lo, length in bucket))
        offset = 0
        for r, lo, length in bucket:
            region = regions[r]
            if region.is_contiguous():
                region.view(-1)[lo:lo + length].copy_(flat[offset:offset + length])
            else:  # e.g. one expert of a fused parameter, or a range along a later axis
                whole = region.reshape(-1).clone()
                whole[lo:lo + length].copy_(flat[offset:offset + length])
                region.copy_(whole.view(region.shape))
            offset += length
        stats.bytes_received += n * flat.element_size()
        stats.buckets_received += 1
        stats.pieces_verified += len(bucket) if verify else 0
    if bad:
        raise WeightSyncError(
            f"weight sync over the rollout bridge: {len(bad)} bucket(s) from training rank {peer} arrived changed "
            f"at rollout rank {rank}; tensors (element ranges) of the first: {bad[0]}")
    return stats


def _describe(layout: ShardLayout, region: tuple[int, int, int], lo: int, length: int) -> str:
    """`name[a:b]` in the tensor's flat elements, or with the axis range for a padded tensor."""
    i, offset, n = region
    t = layout.tensors[i]
    if t.covered is None:
        return f"{t.name}[{lo}:{lo + length}]"
    return f"{t.name}[{t.axis}: {offset}:{offset + n}][{lo}:{lo + length}]"


class BridgeSender:
    """Training rank r's side: reshard into rollout rank r's shard, then send it over the bridge.

    Args:
        train_engine: the `MegatronEngine` of this rank (`spec`, `ranks`, `get_named_weights()`).
        rollout_tp: tensor-parallel size of the rollout engines.
        bucket_bytes: bound on one transfer (in the training world and over the bridge).
        verify_every: verify every k-th sync, the first included (0: never).
    """

    def __init__(self, train_engine: Any, rollout_tp: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 verify_every: int = 1) -> None:
        self.engine = train_engine
        self.bucket_bytes = bucket_bytes
        self.verify_every = checked_verify_every(verify_every)
        self.syncs_done = 0
        self.rank = dist.get_rank()
        self.plan = own_plan(train_engine, rollout_tp, bucket_bytes)
        self.layout = ShardLayout(tuple(ShardTensor.of(t) for t in self.plan.engine_tensors[self.rank]),
                                  self.plan.dtype, self.plan.engine)
        self.bridge: dist.ProcessGroup | None = None

    def connect(self, host: str, port: int, world_size: int) -> None:
        self.bridge = open_bridge(host, port, self.rank, world_size)

    def send(self) -> dict[str, float]:
        """Reshard (a collective of the training world) and send this rank's rollout shard to its
        rollout rank; the rollout rank must be in `BridgeReceiver.receive` at the same time."""
        if self.bridge is None:
            raise ConfigError("weight sync: the rollout bridge is not connected")
        start = time.perf_counter()
        verify = verify_due(self.verify_every, self.syncs_done)
        staged, within = execute_plan(self.plan, engine_shards(self.engine), verify=verify)
        tensors = [staged[t.name] for t in self.layout.tensors]
        sent = send_shard(self.bridge, self.bridge.size() // 2 + self.rank, tensors, self.layout, self.bucket_bytes,
                          verify)
        del staged, tensors
        self.syncs_done += 1
        return {"sync/bytes_sent": float(sent), "sync/bytes_within_training": float(within.bytes_received),
                "sync/send_s": time.perf_counter() - start}


class BridgeReceiver:
    """Rollout rank r's side: receive its shard from training rank r into the rollout engine."""

    def __init__(self, rollout_engine: Any, rank: int, layout: ShardLayout, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 verify_every: int = 1) -> None:
        self.engine = rollout_engine
        self.rank = rank
        self.layout = layout
        self.bucket_bytes = bucket_bytes
        self.verify_every = checked_verify_every(verify_every)
        self.syncs_done = 0
        self.bridge: dist.ProcessGroup | None = None

    def connect(self, host: str, port: int, world_size: int) -> None:
        self.bridge = open_bridge(host, port, world_size // 2 + self.rank, world_size)

    def _targets(self) -> dict[str, torch.Tensor]:
        if self.layout.engine_layout == "hf":
            return {t.name: torch.empty(t.shape, dtype=self.layout.dtype) for t in self.layout.tensors}
        if self.engine.state.value not in ("awake", "weights_only"):
            raise ConfigError(f"rollout engine is {self.engine.state.value}; wake it up before a weight sync")
        return engine_targets(self.engine, self.layout.tensors)

    def receive(self) -> ExecStats:
        if self.bridge is None:
            raise ConfigError("weight sync: the rollout bridge is not connected")
        start = time.perf_counter()
        verify = verify_due(self.verify_every, self.syncs_done)
        peer = self.bridge.rank() - self.bridge.size() // 2
        with torch.no_grad():
            targets = self._targets()
            try:
                stats = receive_shard(self.bridge, peer, [targets[t.name] for t in self.layout.tensors], self.layout,
                                      self.bucket_bytes, verify, self.rank)
            except WeightSyncError:
                if self.layout.engine_layout != "hf":  # written into the engine's parameters in place
                    self.engine.mark_weights_damaged()
                raise
            if self.layout.engine_layout == "hf":
                self.engine.update_weights(targets.items())
            else:
                if any(vllm_expert_view(t.name) for t in self.layout.tensors):
                    self.engine.finish_fused_experts()
                self.engine.mark_weights_updated()
        self.syncs_done += 1
        stats.seconds = time.perf_counter() - start
        return stats
