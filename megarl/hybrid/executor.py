"""Run a `ReshardPlan`: copy local pieces, exchange remote ones bucket by bucket.

Every rank calls `execute_plan` with its own training shards and a plan that covers it (SPMD):
its own plan (`megarl.hybrid.rank_plan.RankPlanner.plan`, as the weight sync runs it) or the
whole-world one. A rank takes its buckets (each the pieces it owes one peer, or is owed, at most
`plan.bucket_bytes`) in rounds of at most `bucket_bytes` sent and as much received
(`exchange_rounds`): it packs a round's sends into one staging buffer, posts non-blocking
receives and sends (batched point-to-point, gloo or NCCL), and unpacks the received buffers
straight into its engine parameters while the next round's transfers are in flight, so its
staging memory is at most 4 x `bucket_bytes` however many peers it has. Engine
parameters have the rollout shard's size, so no rank holds a whole unsharded tensor unless the
rollout TP size is 1.

With `verify` (the default) every piece is fingerprinted by its sender as it is packed and by its
receiver as it is unpacked, and the fingerprints are compared after the sync
(`megarl.hybrid.verify`, point-to-point along the pairs of the plan, then one all-reduce of two
counters): a piece that arrived changed stops the sync on every rank with an error naming tensor,
slice and ranks.

`execute_plan_locally` runs the same packing and unpacking for all ranks in one process with an
in-memory transport (tests, benchmarks of the planning/copy cost).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Collection, Mapping, Protocol

import torch
import torch.distributed as dist

from megarl.errors import ConfigError
from megarl.hybrid.plan import Piece, ReshardPlan
from megarl.hybrid.verify import check_pieces, copy_and_fingerprint

Pair = tuple[int, int]


@dataclass
class ExecStats:
    """What one rank did in one sync. Bytes are in the plan's dtype."""

    rank: int
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied_locally: int = 0
    minimum_bytes: int = 0  # the plan's lower bound on bytes_received (needed - already held)
    buckets_sent: int = 0
    buckets_received: int = 0
    steps: int = 0
    rounds: int = 0  # groups of buckets posted together (`exchange_rounds`)
    # Wall seconds of this rank's sync: in `execute_plan` the exchange; `sync_shards` and
    # `WeightSync.sync` widen it to the whole sync, the engine's taking of the weights included.
    seconds: float = 0.0
    largest_buffer_numel: int = 0  # largest flat exchange buffer (one bucket)
    # Elements of the staging buffers this process allocated (send and receive, both parities):
    # for one rank at most 4 x the plan's bucket (in elements), however many peers it has.
    staging_numel: int = 0
    largest_engine_tensor_numel: int = 0  # largest tensor assembled on this rank
    # Pieces (tensor slices) whose sender and receiver fingerprints were compared, in the whole world
    # (all ranks' receives; the same on every rank); 0 without verification.
    pieces_verified: int = 0
    # Seconds from the last bucket unpacked to the verdict: each sender's fingerprint vectors
    # to its receivers (point-to-point), the receivers' comparison, and the all-reduce in which
    # every rank waits for the slowest (0 without verification). Part of `seconds`. Taking the
    # fingerprints is fused with the packing and unpacking copies and not in it; its cost shows
    # only against a sync without verification (benchmarks/sync_verify.py).
    verify_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _check_shards(plan: ReshardPlan, rank: int, shards: Mapping[str, torch.Tensor]) -> None:
    plan.check_covers(rank)
    for t in plan.train_tensors[rank]:
        got = shards.get(t.name)
        if got is None:
            raise ConfigError(
                f"reshard: rank {rank} lacks training shard {t.name!r}; it has {sorted(shards)[:5]}..."
            )
        if tuple(got.shape) != t.shape:
            raise ConfigError(f"reshard: rank {rank} shard {t.name!r} has shape {tuple(got.shape)}, the plan expects {t.shape}")
        if got.dtype != plan.dtype:
            raise ConfigError(f"reshard: rank {rank} shard {t.name!r} is {got.dtype}, the plan was built for {plan.dtype}")


def _allocate(plan: ReshardPlan, rank: int, device: torch.device,
              out: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Engine tensors at the rollout shard shape (new, or the given `out` after a check); rows no
    block covers (vocabulary padding) are zeroed, the rest is written exactly once by the pieces."""
    targets = {}
    for t in plan.engine_tensors[rank]:
        if out is None:
            tensor = torch.empty(t.shape, dtype=plan.dtype, device=device)
        else:
            tensor = out.get(t.name)
            if tensor is None or tuple(tensor.shape) != t.shape:
                got = None if tensor is None else tuple(tensor.shape)
                raise ConfigError(f"reshard: rank {rank} output {t.name!r} has shape {got}, the plan expects {t.shape}")
        covered = sorted((b.offset, b.offset + b.length) for b in t.blocks)
        start = 0
        for lo, hi in covered + [(t.shape[t.axis], t.shape[t.axis])]:
            if lo > start:
                tensor.narrow(t.axis, start, lo - start).zero_()
            start = max(start, hi)
        targets[t.name] = tensor
    return targets


def _slice(t: torch.Tensor, p: Piece, start: int) -> torch.Tensor:
    return t.narrow(p.axis, start, p.length)


def pack_bucket(pieces: list[Piece], shards: Mapping[str, torch.Tensor], out: torch.Tensor,
                fingerprints: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Write the pieces' slices of the sender's shards into the flat buffer `out`, in order.
    With `fingerprints`, each piece's packed span is fingerprinted as it is copied (appended in order)."""
    offset = 0
    for p in pieces:
        src = _slice(shards[p.src_name], p, p.src_start)
        n = src.numel()
        span = out[offset:offset + n]
        if fingerprints is None:
            span.view(src.shape).copy_(src)
        else:
            fingerprints.append(copy_and_fingerprint(span, src, span_is_src=False))
        offset += n
    return out[:offset]


def unpack_bucket(flat: torch.Tensor, pieces: list[Piece], targets: Mapping[str, torch.Tensor],
                  fingerprints: list[torch.Tensor] | None = None) -> None:
    """Inverse of `pack_bucket` into the receiver's engine parameters; with `fingerprints`, each
    piece's received span is fingerprinted as it is copied out (appended in order)."""
    offset = 0
    for p in pieces:
        dst = _slice(targets[p.dst_name], p, p.dst_start)
        n = dst.numel()
        span = flat[offset:offset + n]
        if fingerprints is None:
            dst.copy_(span.view(dst.shape))
        else:
            fingerprints.append(copy_and_fingerprint(span, dst, span_is_src=True))
        offset += n


def _bucket_numel(pieces: list[Piece], dtype: torch.dtype) -> int:
    return sum(p.nbytes for p in pieces) // torch.empty((), dtype=dtype).element_size()


class Transport(Protocol):
    """Moves one step's flat buffers: `start` posts the transfers, `wait` completes them."""

    def start(self, sends: dict[Pair, torch.Tensor], recvs: dict[Pair, torch.Tensor]) -> Any: ...

    def wait(self, handle: Any) -> None: ...

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks of the sync (verification counters)."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (verification failures only)."""
        ...


class P2PTransport:
    """Batched non-blocking point-to-point sends and receives (gloo or NCCL)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def _peer(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def start(self, sends: dict[Pair, torch.Tensor], recvs: dict[Pair, torch.Tensor]) -> Any:
        # One batch: NCCL would deadlock on two ranks that each receive before they send.
        ops = [dist.P2POp(dist.irecv, buf, self._peer(pair[0]), self.group) for pair, buf in recvs.items()]
        ops += [dist.P2POp(dist.isend, buf, self._peer(pair[1]), self.group) for pair, buf in sends.items()]
        return dist.batch_isend_irecv(ops) if ops else []

    def wait(self, handle: Any) -> None:
        for req in handle:
            req.wait()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out


class InMemoryTransport:
    """All ranks in one process: a send buffer is copied into the matching receive buffer."""

    def start(self, sends: dict[Pair, torch.Tensor], recvs: dict[Pair, torch.Tensor]) -> Any:
        for pair, buf in recvs.items():
            buf.copy_(sends[pair])
        return None

    def wait(self, handle: Any) -> None:
        return None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t  # every rank is in this process: the counts already sum over all of them

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


Op = tuple[int, Pair]  # (step, pair): bucket `step` of the pair


def exchange_rounds(plan: ReshardPlan, ranks: Collection[int]) -> list[list[Op]]:
    """The buckets the ranks in `ranks` exchange, in rounds posted one after the other.

    For one rank (a real sync): its buckets in the order (step, pair), which both ends of a pair
    agree on, cut into rounds that send at most `plan.bucket_bytes` and receive at most as much,
    and hold at most one bucket of each pair,
    so that with two rounds in flight the rank stages at most 4 x `bucket_bytes` whatever the
    number of its peers (a rank of a large expert-parallel layout exchanges with hundreds; a round
    per step, every peer's bucket at once, staged two buffers per peer). Ranks cut their rounds
    differently, which cannot deadlock: each posts in that one order and waits only on what it
    posted, so the first unfinished bucket of the world is posted at both its ends and finishes.
    For several ranks in one process (the in-memory transport hands a send to its receive when
    both are posted together): one round per step."""
    if len(ranks) != 1:
        return [[(k, pair) for pair in sorted(step)] for k, step in enumerate(plan.steps)]
    (rank,) = ranks
    budget = max(1, plan.bucket_bytes)
    rounds: list[list[Op]] = []
    current: list[Op] = []
    sent = received = 0
    for k, step in enumerate(plan.steps):
        for pair in sorted(step):
            if rank not in pair:
                continue
            nbytes = sum(p.nbytes for p in step[pair])
            out, into = (nbytes, 0) if pair[0] == rank else (0, nbytes)
            # A pair exchanges at most one bucket per round (the transport keys a round's buffers by pair).
            if current and (sent + out > budget or received + into > budget or any(q == pair for _, q in current)):
                rounds.append(current)
                current, sent, received = [], 0, 0
            current.append((k, pair))
            sent += out
            received += into
    if current:
        rounds.append(current)
    return rounds


def _run(plan: ReshardPlan, shards_by_rank: Mapping[int, Mapping[str, torch.Tensor]], transport: Transport,
         device: torch.device, out: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
         verify: bool = True) -> dict[int, tuple[dict[str, torch.Tensor], ExecStats]]:
    """The round loop for the ranks in `shards_by_rank` (rounds: `exchange_rounds`).

    Double-buffered: round r+1 is packed and posted while round r is in flight, so at most two
    rounds are in flight; each round's send and receive buffers are views of one staging buffer
    per direction and parity, reused across rounds. Local pieces are copied while the first round
    is in flight.
    """
    start = time.perf_counter()
    result: dict[int, tuple[dict[str, torch.Tensor], ExecStats]] = {}
    for rank, shards in shards_by_rank.items():
        _check_shards(plan, rank, shards)
        targets = _allocate(plan, rank, device, None if out is None else out[rank])
        stats = ExecStats(rank=rank, minimum_bytes=plan.bytes[rank].minimum, steps=len(plan.steps))
        stats.largest_engine_tensor_numel = max((t.numel() for t in targets.values()), default=0)
        result[rank] = (targets, stats)

    rounds = exchange_rounds(plan, list(shards_by_rank))
    numel = {(k, pair): _bucket_numel(plan.steps[k][pair], plan.dtype) for ops in rounds for k, pair in ops}

    def kinds(pair: Pair) -> list[tuple[int, str]]:
        return [(rank, kind) for rank, kind in ((pair[0], "send"), (pair[1], "recv")) if rank in shards_by_rank]

    # Staging: per direction, the largest round's total (both parities alike, allocated on first use).
    size = {"send": 0, "recv": 0}
    for ops in rounds:
        for kind in size:
            size[kind] = max(size[kind], sum(numel[op] for op in ops for _, k in kinds(op[1]) if k == kind))
    staging: dict[tuple[str, int], torch.Tensor] = {}
    # Per bucket (step, pair): its pieces' fingerprints, taken by the sender and by the receiver.
    sent_fp: dict[Op, list[torch.Tensor]] = {}
    received_fp: dict[Op, list[torch.Tensor]] = {}

    def post(r: int) -> tuple[Any, dict[Op, torch.Tensor]]:
        sends, recvs = {}, {}
        received: dict[Op, torch.Tensor] = {}
        offset = {"send": 0, "recv": 0}
        for op in rounds[r]:
            k, pair = op
            n = numel[op]
            for rank, kind in kinds(pair):
                key = (kind, r % 2)
                if key not in staging:
                    staging[key] = torch.empty(size[kind], dtype=plan.dtype, device=device)
                buf = staging[key][offset[kind]:offset[kind] + n]
                offset[kind] += n
                stats = result[rank][1]
                stats.largest_buffer_numel = max(stats.largest_buffer_numel, n)
                if kind == "send":
                    sink = sent_fp.setdefault(op, []) if verify else None
                    sends[pair] = pack_bucket(plan.steps[k][pair], shards_by_rank[rank], buf, sink)
                    stats.bytes_sent += n * buf.element_size()
                    stats.buckets_sent += 1
                else:
                    recvs[pair] = received[op] = buf
        return transport.start(sends, recvs), received

    pending = post(0) if rounds else None
    for rank, (targets, stats) in result.items():  # while the first round is on its way
        shards = shards_by_rank[rank]
        for p in plan.local_pieces[rank]:
            _slice(targets[p.dst_name], p, p.dst_start).copy_(_slice(shards[p.src_name], p, p.src_start))
            stats.bytes_copied_locally += p.nbytes
    for r in range(len(rounds)):
        handle, received = pending
        # Pack and post round r+1 before waiting for round r: its buffers (the other parity) were
        # released when round r-1 was waited for and unpacked.
        pending = post(r + 1) if r + 1 < len(rounds) else None
        transport.wait(handle)
        for (k, pair), buf in received.items():
            targets, stats = result[pair[1]]
            sink = received_fp.setdefault((k, pair), []) if verify else None
            unpack_bucket(buf, plan.steps[k][pair], targets, sink)
            stats.bytes_received += buf.numel() * buf.element_size()
            stats.buckets_received += 1
    staged = sum(t.numel() for t in staging.values())
    for _, stats in result.values():
        stats.rounds = len(rounds)
        stats.staging_numel = staged
    checked, verify_seconds = 0, 0.0
    if verify:
        t0 = time.perf_counter()
        checked = check_pieces(plan, shards_by_rank, sent_fp, received_fp, transport, device)
        verify_seconds = time.perf_counter() - t0
    elapsed = time.perf_counter() - start
    for _, stats in result.values():
        stats.seconds = elapsed
        stats.verify_seconds = verify_seconds
        stats.pieces_verified = checked
    return result


def execute_plan(plan: ReshardPlan, local_shards: Mapping[str, torch.Tensor],
                 group: dist.ProcessGroup | None = None, out: Mapping[str, torch.Tensor] | None = None,
                 verify: bool = True, transport: Transport | None = None,
                 ) -> tuple[dict[str, torch.Tensor], ExecStats]:
    """This rank's engine parameters (name -> tensor of the rollout shard shape) and its stats.

    `local_shards`: this rank's Megatron parameters by local-spec name (stage-local layer
    indices), e.g. `megarl.hybrid.sync.training_shards(engine.get_named_weights(), ...)`. Ranks in the plan are ranks of
    `group` (default: the world). Every rank of the group must call this with a plan that covers
    it, all of one planning (its own plan from `RankPlanner`, or the same whole-world plan).
    `out`: write into these tensors (e.g. the engine's own parameters, any dtype) instead of
    allocating new ones. `verify`: compare sender and receiver fingerprints of every bucket (a
    collective; every rank must pass the same value). `transport`: point-to-point over `group` by
    default.
    """
    rank = dist.get_rank(group)
    if dist.get_world_size(group) != plan.world_size:
        raise ConfigError(f"reshard: plan is for {plan.world_size} ranks, the group has {dist.get_world_size(group)}")
    device = next(iter(local_shards.values())).device if local_shards else torch.device("cpu")
    return _run(plan, {rank: local_shards}, transport or P2PTransport(group), device,
                None if out is None else {rank: out}, verify)[rank]


def execute_plan_locally(plan: ReshardPlan, shards_by_rank: Mapping[int, Mapping[str, torch.Tensor]],
                         out: Mapping[int, Mapping[str, torch.Tensor]] | None = None, verify: bool = True,
                         ) -> dict[int, tuple[dict[str, torch.Tensor], ExecStats]]:
    """All ranks in this process: the same packing and unpacking, buffers handed over in memory.
    `plan` must cover every rank (`build_reshard_plan`, or `ReshardPlan.union` of every rank's own
    plan). `out`: per rank, tensors to write into (as in `execute_plan`)."""
    missing = sorted(set(range(plan.world_size)) - set(shards_by_rank))
    if missing:
        raise ConfigError(f"reshard: no training shards given for ranks {missing}")
    return _run(plan, shards_by_rank, InMemoryTransport(), torch.device("cpu"), out, verify)
