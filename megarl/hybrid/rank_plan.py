"""The reshard plan of one rank, built by that rank alone at a cost independent of the world size.

`build_reshard_plan` enumerates every rank's pieces on every rank, so its cost grows with the
world. Here a rank plans only its own pieces:

- as a receiver: its engine parameters (one rollout TP rank's slice of the model), each block cut
  at the training shard boundaries; rows its own training shard holds are copied locally, the
  others come from the sender `megarl.hybrid.sender_rule` names;
- as a sender: for each engine parameter of any rollout TP rank that overlaps its own shard, the
  receivers whose rule names it, listed in closed form (`sender_rule.receivers_at`).

The tables it needs describe the model once per model shard and once per rollout TP rank
(`source_index`, `engine_params`): tp * pp + rollout tp slices of the model, independent of dp and
cp. The schedule is shared without communication: each (sender, receiver) pair's pieces are in the
receiver's parameter and row order, cut into buckets of at most `bucket_bytes`, bucket k in
step k, so both ends of a pair agree on every transfer.

The result is a `ReshardPlan` covering the one rank, equal to the whole-world plan that
`build_reshard_plan(..., senders="by_rank")` builds restricted to the rank (`ReshardPlan.restrict`;
tested for many layouts); the weight sync runs it (`megarl.hybrid.sync.WeightSync`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megarl.errors import ConfigError
from megarl.hybrid.plan import (
    DEFAULT_BUCKET_BYTES, Piece, RankBytes, ReshardPlan, _bucket, _merge, _Segment, _segments, _unit_bytes,
    check_plan_inputs, join_pieces, rank_tensors, rule_sender, segment_piece, source_index,
)
from megarl.hybrid.sender_rule import (
    is_expert_key, receivers_at, replica_index, replicas_per_holder, shard_keys,
)
from megarl.hybrid.slices import engine_params, hf_tensor_shapes
from megarl.layout import ParallelLayout

if TYPE_CHECKING:
    from megarl.models.spec import ModelSpec

Pair = tuple[int, int]


@dataclass(frozen=True, slots=True)
class _Template:
    """A segment of an engine parameter with one set of holders: the same for every receiver with
    that rollout TP rank (only the sender depends on the receiver)."""

    seg: _Segment  # dst and src unset
    holder_keys: frozenset[tuple[int, int, int]]


class RankPlanner:
    """Plans any rank of (`train`, `rollout`); arguments as `build_reshard_plan`. Building it and
    planning one rank cost the same at any data/context-parallel size."""

    def __init__(self, spec: "ModelSpec", train: ParallelLayout, rollout: ParallelLayout, engine: str = "hf",
                 dtype: torch.dtype = torch.float32, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 hf_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        check_plan_inputs(train, rollout, bucket_bytes)
        spec.check_layout(train.tp, train.pp, train.ep, train.etp)
        shapes = hf_shapes if hf_shapes is not None else hf_tensor_shapes(spec)
        self.train, self.rollout, self.engine = train, rollout, engine
        self.dtype, self.bucket_bytes = dtype, bucket_bytes
        self.shards, self.sources = source_index(spec, train, shapes)
        self.shard_by_name = {key: {t.name: t for t in ts} for key, ts in self.shards.items()}
        self.params = [engine_params(spec, engine, t, rollout.tp, shapes) for t in range(rollout.tp)]
        # HF name -> (rollout tp rank, parameter index) of every engine parameter holding its rows.
        self.users: dict[str, set[tuple[int, int]]] = {}
        for t, params in enumerate(self.params):
            for i, param in enumerate(params):
                for b in param.blocks:
                    self.users.setdefault(b.hf_name, set()).add((t, i))
        self._templates: dict[tuple[int, int], list[_Template]] = {}

    @property
    def world_size(self) -> int:
        return self.train.world_size

    def templates(self, t: int, i: int) -> list[_Template]:
        """Segments of parameter `i` of rollout TP rank `t`, in block and row order (cached)."""
        key = (t, i)
        if key not in self._templates:
            param = self.params[t][i]
            unit = _unit_bytes(param, self.dtype)
            out = []
            for block in param.blocks:
                for seg in _segments(block, self.sources, (), -1, param, unit, self.shard_by_name):
                    seg.salt = i + len(out)
                    out.append(_Template(seg, frozenset(h.coord_key for h in seg.holders)))
            self._templates[key] = out
        return self._templates[key]

    def plan(self, rank: int) -> ReshardPlan:
        """`rank`'s own plan: a `ReshardPlan` covering `rank` alone (its pieces, the buckets it
        sends and receives, its bytes). Raises AssertionError if it would receive more than the
        minimum (a planner bug, as in `build_reshard_plan`)."""
        counts, local_pieces, remote = self.received(rank)
        for piece in self._sent(rank):  # every receiver whose rule names this rank
            counts.sent += piece.nbytes
            remote.setdefault((rank, piece.dst), []).append(piece)
        return ReshardPlan(self.train, self.rollout, self.engine, self.dtype, self.bucket_bytes,
                           {rank: self.params[self.rollout.coord(rank).tp_rank]},
                           {rank: rank_tensors(self.shards, self.train, rank)}, {rank: local_pieces},
                           _bucket(remote, self.bucket_bytes), {rank: counts})

    def received(self, rank: int) -> tuple[RankBytes, list[Piece], dict[Pair, list[Piece]]]:
        """The receiving half of `rank`'s plan: its bytes (`sent` left 0), the pieces it copies
        locally and those it receives, by (sender, rank). Raises AssertionError if it would
        receive more than the minimum."""
        own = shard_keys(self.train, rank)
        t = self.rollout.coord(rank).tp_rank
        counts = RankBytes()
        segments: list[_Segment] = []  # this rank's engine parameters, in the full plan's order
        for i in range(len(self.params[t])):
            for tpl in self.templates(t, i):
                seg = _copy(tpl.seg, rank)
                counts.needed += seg.nbytes
                mine = [h for h in seg.holders if h.coord_key in own]
                if mine:
                    seg.src, seg.source = rank, mine[0]
                    counts.local += seg.nbytes
                else:
                    seg.src, seg.source = rule_sender(self.train, seg.holders, rank, seg.salt)
                segments.append(seg)
        local_pieces: list[Piece] = []
        remote: dict[Pair, list[Piece]] = {}
        for piece in _merge(segments):
            if piece.src == rank:
                local_pieces.append(piece)
            else:
                counts.received += piece.nbytes
                remote.setdefault((piece.src, rank), []).append(piece)
        if counts.received != counts.minimum:
            raise AssertionError(f"reshard plan: rank {rank} receives {counts.received} bytes, minimum {counts.minimum}")
        return counts, local_pieces, remote

    def received_pairs(self, rank: int) -> tuple[RankBytes, dict[Pair, tuple[int, int]]]:
        """`rank`'s bytes (`sent` left 0) and, per (sender, rank) pair, the bytes and buckets it
        receives: what a whole-world summary needs (every pair is some rank's receive)."""
        counts, _, remote = self.received(rank)
        steps = _bucket(remote, self.bucket_bytes)
        return counts, {pair: (sum(p.nbytes for p in pieces), sum(pair in step for step in steps))
                        for pair, pieces in remote.items()}

    def _sent(self, rank: int) -> list[Piece]:
        """Pieces `rank` sends, per receiver in the receiver's parameter and row order."""
        train = self.train
        own = shard_keys(train, rank)
        rollout_tp = self.rollout.tp
        mine = [t_ for key in dict.fromkeys(own) if key in self.shards for t_ in self.shards[key]]
        touched = sorted({u for t_ in mine for b in t_.blocks for u in self.users.get(b.hf_name, ())})
        out: list[Piece] = []
        for t, i in touched:
            pieces: dict[int, list[Piece]] = {}  # receiver -> its pieces from this rank, in order
            previous: set[int] = set()  # receivers of the previous segment from this rank
            for tpl in self.templates(t, i):
                now: set[int] = set()
                holders = tpl.seg.holders
                expert = is_expert_key(holders[0].coord_key)
                per_holder = replicas_per_holder(train, holders[0].coord_key)
                j = replica_index(train, rank, expert)  # this rank's index among the holder's ranks
                for k, holder in enumerate(holders):
                    if holder.coord_key not in own:
                        continue
                    for dst in receivers_at(train, k * per_holder + j, len(holders), per_holder, tpl.seg.salt,
                                            expert):
                        # Rollout TP is the fastest rank coordinate (`ParallelLayout.rollout`).
                        if dst % rollout_tp != t or not tpl.holder_keys.isdisjoint(shard_keys(train, dst)):
                            continue  # another engine slice, or the receiver holds the rows itself
                        seg = _copy(tpl.seg, dst)
                        seg.src, seg.source = rank, holder
                        piece = segment_piece(seg)
                        mine_for_dst = pieces.setdefault(dst, [])
                        # Only a piece right after one of ours in the receiver's order may join it.
                        joined = join_pieces(mine_for_dst[-1], piece) if dst in previous else None
                        if joined is not None:
                            mine_for_dst[-1] = joined
                        else:
                            mine_for_dst.append(piece)
                        now.add(dst)
                previous = now
            for dst in sorted(pieces):
                out += pieces[dst]
        return out


def _copy(seg: _Segment, dst: int) -> _Segment:
    return _Segment(dst, seg.param, seg.axis, seg.dst_start, seg.length, seg.nbytes, seg.lo, seg.holders,
                    salt=seg.salt)


def plan_for_rank(spec: "ModelSpec", train: ParallelLayout, rollout: ParallelLayout, rank: int,
                  engine: str = "hf", dtype: torch.dtype = torch.float32,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                  hf_shapes: dict[str, tuple[int, ...]] | None = None) -> ReshardPlan:
    """`rank`'s plan (see `RankPlanner`); raises ConfigError for a rank outside the world."""
    if not 0 <= rank < train.world_size:
        raise ConfigError(f"reshard plan: rank {rank} outside the world [0, {train.world_size})")
    return RankPlanner(spec, train, rollout, engine, dtype, bucket_bytes, hf_shapes).plan(rank)

