"""The reshard plan: for every rollout rank and every engine parameter, which training rank sends
which slice, and where it lands.

A `ReshardPlan` covers some ranks: for each its engine parameters, training shards, local copies
and bytes, and of the exchange schedule every bucket one of them sends or receives. A rank's own
plan (`megarl.hybrid.rank_plan.RankPlanner`, what the weight sync runs) covers that rank alone;
the whole-world plan of `build_reshard_plan` covers every rank and is the union of the ranks' own
plans (`ReshardPlan.union`, `ReshardPlan.restrict`). Both are built from the model spec and the two
`megarl.layout.ParallelLayout`s (training; rollout from `ParallelLayout.rollout`) with no
communication, so all ranks agree on the exchange schedule. Rows the receiving rank holds itself
are copied locally (zero bytes); the others come from one of the training replicas that hold them
(DP and CP ranks, and TP ranks for replicated tensors, hold identical weights): the least-loaded
one, or by the closed-form rule of `megarl.hybrid.sender_rule`. Remote pieces go in buckets of
at most `bucket_bytes` per (sender, receiver) pair and step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megarl.errors import ConfigError
from megarl.hybrid.sender_rule import (
    EVERY_EP_RANK, ShardKey, holder_rank, holder_ranks, is_expert_key, replicas_per_holder, sender_position,
    shard_keys,
)
from megarl.hybrid.slices import Block, LocalTensor, engine_params, hf_tensor_shapes, megatron_shards
from megarl.layout import ParallelLayout

if TYPE_CHECKING:
    from megarl.models.spec import ModelSpec

DEFAULT_BUCKET_BYTES = 64 * 2**20
SENDER_RULES = ("least_loaded", "by_rank")


@dataclass(frozen=True, slots=True)
class Piece:
    """`length` slices along `axis`: training rank `src`'s shard `src_name` from `src_start`
    -> rollout rank `dst`'s engine parameter `dst_name` from `dst_start`."""

    src: int
    dst: int
    src_name: str
    dst_name: str
    axis: int
    src_start: int
    dst_start: int
    length: int
    nbytes: int


@dataclass
class RankBytes:
    """Byte accounting of one rank. `minimum` = needed - local: what any plan must receive."""

    needed: int = 0  # real (non-padding) bytes of this rank's rollout shard
    local: int = 0  # of those, bytes this rank's training shard already holds
    received: int = 0
    sent: int = 0

    @property
    def minimum(self) -> int:
        return self.needed - self.local


@dataclass
class ReshardPlan:
    """Everything the executor needs for the ranks the plan covers (`ranks`).

    Per covered rank: engine parameters, Megatron shards, local pieces and bytes. `steps[k]`
    holds bucket k of every (sender, receiver) pair with an end among the covered ranks; a pair's
    bucket k is in step k in every plan that holds the pair, so the plans of two ranks agree on
    what passes between them."""

    train: ParallelLayout
    rollout: ParallelLayout  # pp = cp = ep = 1 (`ParallelLayout.rollout`)
    engine: str
    dtype: torch.dtype
    bucket_bytes: int
    engine_tensors: dict[int, list[LocalTensor]]  # rollout rank -> its engine parameters
    train_tensors: dict[int, list[LocalTensor]]  # training rank -> its Megatron shards
    local_pieces: dict[int, list[Piece]]  # rank -> pieces it copies from itself
    steps: list[dict[tuple[int, int], list[Piece]]]  # step -> (src, dst) -> pieces of one bucket
    bytes: dict[int, RankBytes] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.train.world_size

    @property
    def ranks(self) -> list[int]:
        """The ranks this plan covers, ascending (all of the world for `build_reshard_plan`)."""
        return sorted(self.engine_tensors)

    def total_received(self) -> int:
        return sum(b.received for b in self.bytes.values())

    def restrict(self, rank: int) -> "ReshardPlan":
        """The part of this plan that concerns `rank`: what `RankPlanner.plan(rank)` builds alone
        (steps after its last bucket dropped). Raises ConfigError if the plan does not cover it."""
        self.check_covers(rank)
        steps = [{pair: ps for pair, ps in step.items() if rank in pair} for step in self.steps]
        while steps and not steps[-1]:
            steps.pop()
        return ReshardPlan(self.train, self.rollout, self.engine, self.dtype, self.bucket_bytes,
                           {rank: self.engine_tensors[rank]}, {rank: self.train_tensors[rank]},
                           {rank: self.local_pieces[rank]}, steps, {rank: self.bytes[rank]})

    @staticmethod
    def union(plans: "list[ReshardPlan]") -> "ReshardPlan":
        """One plan covering the ranks of all `plans` (e.g. every rank's own plan: the whole-world
        plan). Raises ConfigError if they are for different layouts, engines, dtypes or bucket
        sizes, cover a rank twice, or disagree on a bucket both ends of a pair hold."""
        if not plans:
            raise ConfigError("reshard plan: union of no plans")
        first = plans[0]
        out = ReshardPlan(first.train, first.rollout, first.engine, first.dtype, first.bucket_bytes, {}, {}, {}, [], {})
        for p in plans:
            if (p.train, p.rollout, p.engine, p.dtype, p.bucket_bytes) != (
                    first.train, first.rollout, first.engine, first.dtype, first.bucket_bytes):
                raise ConfigError(f"reshard plan: the plan of ranks {p.ranks} is for another layout, engine, "
                                  f"dtype or bucket size than that of ranks {first.ranks}")
            twice = set(p.engine_tensors) & set(out.engine_tensors)
            if twice:
                raise ConfigError(f"reshard plan: ranks {sorted(twice)} are covered by two plans")
            for part in ("engine_tensors", "train_tensors", "local_pieces", "bytes"):
                getattr(out, part).update(getattr(p, part))
            for k, step in enumerate(p.steps):
                while len(out.steps) <= k:
                    out.steps.append({})
                for pair, pieces in step.items():
                    if out.steps[k].setdefault(pair, pieces) != pieces:
                        raise ConfigError(f"reshard plan: ranks {pair[0]} and {pair[1]} disagree on their "
                                          f"bucket of step {k}")
        return out

    def check_covers(self, rank: int) -> None:
        """Raises ConfigError if this plan has no part for `rank`."""
        if rank not in self.engine_tensors:
            shown = self.ranks if len(self.engine_tensors) <= 8 else f"{len(self.engine_tensors)} ranks"
            raise ConfigError(f"reshard: the plan does not cover rank {rank} (it covers {shown})")


def _unit_bytes(t: LocalTensor, dtype: torch.dtype) -> int:
    numel = 1
    for i, s in enumerate(t.shape):
        if i != t.axis:
            numel *= s
    return numel * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class _Source:
    coord_key: ShardKey  # (tp, pp, ep_rank or EVERY_EP_RANK)
    name: str
    start: int  # HF rows
    stop: int
    local_offset: int


def build_reshard_plan(
    spec: "ModelSpec",
    train: ParallelLayout,
    rollout: ParallelLayout,
    engine: str = "hf",
    dtype: torch.dtype = torch.float32,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    hf_shapes: dict[str, tuple[int, ...]] | None = None,
    senders: str = "least_loaded",
) -> ReshardPlan:
    """Plan the move of the training shards of `train` into engine parameters of `rollout`.

    Args:
        engine: "hf" (HF-named full tensors; rollout tp must be 1) or "vllm" (vLLM per-rank
            fused parameters).
        dtype: training parameter dtype (bytes are counted in it; it is also what moves).
        bucket_bytes: most bytes one (sender, receiver) pair exchanges in one step.
        hf_shapes: HF tensor shapes (default: built from `spec.hf_config` on the meta device).
        senders: "least_loaded" (greedy over the whole world) or "by_rank" (`megarl.hybrid.
            sender_rule`, the choice `megarl.hybrid.rank_plan` makes for one rank alone).
    Raises ConfigError if the world sizes differ, the model does not split, or a slice unit (one
    row or column) exceeds `bucket_bytes`.
    """
    if senders not in SENDER_RULES:
        raise ConfigError(f"reshard plan: senders={senders!r} unknown; valid: {SENDER_RULES}")
    check_plan_inputs(train, rollout, bucket_bytes)
    spec.check_layout(train.tp, train.pp, train.ep, train.etp)
    shapes = hf_shapes if hf_shapes is not None else hf_tensor_shapes(spec)
    world = train.world_size
    coords = [train.coord(r) for r in range(world)]  # once: step 2 reads them per segment

    shard_cache, sources = source_index(spec, train, shapes)
    train_tensors = {r: rank_tensors(shard_cache, train, r) for r in range(world)}
    shard_by_name = {key: {t.name: t for t in ts} for key, ts in shard_cache.items()}

    engine_tensors = {g: engine_params(spec, engine, rollout.coord(g).tp_rank, rollout.tp, shapes)
                       for g in range(world)}
    # 1. Cut every engine block into segments with one set of holders each.
    segments: list[_Segment] = []
    plan_bytes = {r: RankBytes() for r in range(world)}
    for dst in range(world):
        for i, param in enumerate(engine_tensors[dst]):
            unit = _unit_bytes(param, dtype)
            salt = i
            for block in param.blocks:
                plan_bytes[dst].needed += block.length * unit
                cut = _segments(block, sources, shard_keys(train, dst), dst, param, unit, shard_by_name)
                for seg in cut:
                    seg.salt, salt = salt, salt + 1
                # What the rank holds, counted before any sender is chosen.
                plan_bytes[dst].local += sum(seg.nbytes for seg in cut if seg.src == dst)
                segments += cut
    # 2. Choose senders: the receiver itself when it holds the rows; otherwise, largest segments
    # first, the replica that has sent least so far (then one in the receiver's DP index), or
    # with senders="by_rank" the candidate `sender_rule` names.
    sent = [0] * world
    for seg in sorted(segments, key=lambda s: (s.src < 0, -s.nbytes)):
        if seg.src >= 0:
            continue
        if senders == "by_rank":
            seg.src, seg.source = rule_sender(train, seg.holders, seg.dst, seg.salt)
            continue
        dst_dp = coords[seg.dst].dp_rank
        options = [(sent[r], coords[r].dp_rank != dst_dp, r, h) for h in seg.holders
                   for r in holder_ranks(train, h.coord_key)]
        _, _, seg.src, seg.source = min(options, key=lambda o: o[:3])
        sent[seg.src] += seg.nbytes
    # 3. Merge adjacent segments from the same source into pieces.
    local_pieces: dict[int, list[Piece]] = {r: [] for r in range(world)}
    remote: dict[tuple[int, int], list[Piece]] = {}
    for piece in _merge(segments):
        if piece.src == piece.dst:
            local_pieces[piece.dst].append(piece)
        else:
            plan_bytes[piece.dst].received += piece.nbytes
            plan_bytes[piece.src].sent += piece.nbytes
            remote.setdefault((piece.src, piece.dst), []).append(piece)
    for rank, b in plan_bytes.items():  # zero redundancy: nothing a rank already holds is sent to it
        if b.received != b.minimum:
            raise AssertionError(f"reshard plan: rank {rank} receives {b.received} bytes, minimum {b.minimum}")
    steps = _bucket(remote, bucket_bytes)
    return ReshardPlan(train, rollout, engine, dtype, bucket_bytes, engine_tensors, train_tensors,
                       local_pieces, steps, plan_bytes)


def check_plan_inputs(train: ParallelLayout, rollout: ParallelLayout, bucket_bytes: int) -> None:
    if train.world_size != rollout.world_size:
        raise ConfigError(f"train world size {train.world_size} != rollout world size {rollout.world_size}")
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")


def source_index(spec: "ModelSpec", train: ParallelLayout, shapes: dict[str, tuple[int, ...]]
                 ) -> tuple[dict[ShardKey, list[LocalTensor]], dict[str, list[_Source]]]:
    """Every shard's Megatron tensors, and per HF name the blocks some shard holds (the holder
    order the sender rule counts in). Shards: (tp, pp, EVERY_EP_RANK) for what every expert-
    parallel rank of a model shard holds (everything when the experts split as the dense weights:
    ep = 1 and etp = tp), and otherwise (etp_rank, pp, e) for the experts of expert-TP rank etp_rank
    and ep rank e. Cost: tp * pp model shards and etp * pp * ep expert shards, independent of dp
    and cp."""
    shard_cache: dict[ShardKey, list[LocalTensor]] = {}
    sources: dict[str, list[_Source]] = {}
    split = train.experts_split_apart
    parts = [((tp, pp, EVERY_EP_RANK), dict(tp_rank=tp, tp_size=train.tp, experts=False if split else None))
             for tp in range(train.tp) for pp in range(train.pp)]
    if split:
        parts += [((etp, pp, e), dict(tp_rank=etp, tp_size=train.etp, ep_rank=e, ep_size=train.ep, experts=True))
                  for etp in range(train.etp) for pp in range(train.pp) for e in range(train.ep)]
    for key, kwargs in parts:
        shard_cache[key] = megatron_shards(spec, pp_rank=key[1], pp_size=train.pp, shapes=shapes, **kwargs)
        for t in shard_cache[key]:
            for b in t.blocks:
                sources.setdefault(b.hf_name, []).append(_Source(key, t.name, b.start, b.stop, b.offset))
    return shard_cache, sources


def rank_tensors(shard_cache: dict[ShardKey, list[LocalTensor]], train: ParallelLayout, rank: int) -> list[LocalTensor]:
    """The Megatron tensors training rank `rank` holds."""
    every, experts = shard_keys(train, rank)
    return shard_cache[every] + (shard_cache[experts] if train.experts_split_apart else [])


def rule_sender(train: ParallelLayout, holders: list[_Source], dst: int, salt: int) -> tuple[int, _Source]:
    """The (rank, holder) `sender_rule` assigns to receiver `dst` for rows all `holders` hold."""
    key = holders[0].coord_key  # expert rows or not: the same for all holders
    per_holder = replicas_per_holder(train, key)
    position = sender_position(train, dst, len(holders), per_holder, salt, is_expert_key(key))
    holder = holders[position // per_holder]
    return holder_rank(train, holder.coord_key, position % per_holder), holder


@dataclass(slots=True)
class _Segment:
    """Rows [lo, hi) of an engine block with the same holders; `src` -1 until a sender is chosen."""

    dst: int
    param: LocalTensor
    axis: int
    dst_start: int
    length: int
    nbytes: int
    lo: int
    holders: list[_Source]
    src: int = -1
    source: _Source | None = None
    salt: int = 0  # parameter index + segment index in it: the sender rule's per-segment shift


def _segments(block: Block, sources: dict[str, list[_Source]], own: tuple[ShardKey, ...], dst: int,
              param: LocalTensor, unit: int,
              shard_by_name: dict[ShardKey, dict[str, LocalTensor]]) -> list[_Segment]:
    """Cut one engine block at every source boundary; segments the receiver holds get src=dst."""
    cands = [s for s in sources.get(block.hf_name, []) if s.start < block.stop and s.stop > block.start]
    cuts = sorted({block.start, block.stop} | {x for s in cands for x in (s.start, s.stop)
                                               if block.start < x < block.stop})
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        holders = [s for s in cands if s.start <= lo and s.stop >= hi]
        if not holders:
            raise ConfigError(f"reshard plan: no training rank holds rows [{lo}, {hi}) of {block.hf_name}")
        axis = shard_by_name[holders[0].coord_key][holders[0].name].axis
        if axis != param.axis:
            raise ConfigError(f"reshard plan: {block.hf_name} split on axis {axis} in training, {param.axis} in the engine")
        seg = _Segment(dst, param, axis, block.offset + lo - block.start, hi - lo, (hi - lo) * unit, lo, holders)
        mine = [s for s in holders if s.coord_key in own]
        if mine:
            seg.src, seg.source = dst, mine[0]
        out.append(seg)
    return out


def _merge(segments: list[_Segment]) -> list[Piece]:
    pieces: list[Piece] = []
    for seg in segments:  # in receiver, parameter and row order
        piece = segment_piece(seg)
        joined = join_pieces(pieces[-1], piece) if pieces else None
        if joined is not None:
            pieces[-1] = joined
        else:
            pieces.append(piece)
    return pieces


def segment_piece(seg: _Segment) -> Piece:
    src = seg.source
    assert src is not None
    return Piece(seg.src, seg.dst, src.name, seg.param.name, seg.axis, src.local_offset + seg.lo - src.start,
                 seg.dst_start, seg.length, seg.nbytes)


def join_pieces(last: Piece, piece: Piece) -> Piece | None:
    """`last` extended by `piece` when it continues it on both ends, else None."""
    if (last.src == piece.src and last.dst == piece.dst and last.src_name == piece.src_name
            and last.dst_name == piece.dst_name and last.src_start + last.length == piece.src_start
            and last.dst_start + last.length == piece.dst_start):
        return dataclasses.replace(last, length=last.length + piece.length, nbytes=last.nbytes + piece.nbytes)
    return None


def _bucket(remote: dict[tuple[int, int], list[Piece]], bucket_bytes: int) -> list[dict[tuple[int, int], list[Piece]]]:
    """Split each pair's pieces into buckets of at most `bucket_bytes`; bucket k goes in step k."""
    steps: list[dict[tuple[int, int], list[Piece]]] = []
    for pair in sorted(remote):
        buckets: list[list[Piece]] = [[]]
        room = bucket_bytes
        for piece in remote[pair]:
            unit = piece.nbytes // piece.length
            if unit > bucket_bytes:
                raise ConfigError(
                    f"reshard plan: one slice of {piece.src_name} is {unit} bytes, more than "
                    f"bucket_bytes={bucket_bytes}; raise the bucket size"
                )
            if piece.nbytes <= room:  # fits whole: most pieces
                buckets[-1].append(piece)
                room -= piece.nbytes
                continue
            done = 0
            while done < piece.length:
                take = min(piece.length - done, room // unit)
                if take == 0:
                    buckets.append([])
                    room = bucket_bytes
                    continue
                buckets[-1].append(Piece(piece.src, piece.dst, piece.src_name, piece.dst_name, piece.axis,
                                         piece.src_start + done, piece.dst_start + done, take, take * unit))
                room -= take * unit
                done += take
        for k, bucket in enumerate(b for b in buckets if b):
            while len(steps) <= k:
                steps.append({})
            steps[k][pair] = bucket
    return steps
