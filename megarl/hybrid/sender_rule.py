"""Which training rank sends a slice to a rollout rank: a rule every rank evaluates alone.

A slice that the receiver does not hold itself has candidates: the training ranks of its holding
shards, in the plan's holder order, each shard's ranks in replica order. A shard is either a model
shard (tp_rank, pp_rank) of the weights every expert-parallel rank holds, with h = dp*cp replicas
(DP-major, `ParallelLayout.replicas`), or an expert shard (etp_rank, pp_rank, ep_rank) with
h = edp = tp*cp*dp / (etp*ep) replicas (its expert data-parallel ranks, `ParallelLayout.
expert_rank`). n = holders x h candidates; receiver `dst` takes candidate

    position(dst) = (replica_major(dst) + salt) mod n,
    replica_major = replica(dst) + h * (split(dst) + splits * pp(dst))

with dst's own training coordinates: for model shards replica = dp * cp_size + cp, split = tp,
splits = tp_size; for expert shards replica = edp_rank, split = etp_rank, splits = etp, so the ep
ranks of one (edp, etp, pp) position share a candidate. `salt` is the
segment's ordinal in the engine parameters of its rollout TP rank (parameter index + segment
index). The replica index varies fastest, so receivers that want the same rows from one shard
spread evenly over its replicas, and for rows every tensor-parallel shard holds (norms) the holder
follows the receiver's own TP index; the salt makes one receiver take successive segments from
successive replicas. Because the rule is arithmetic, a sender can list its receivers without looking
at any other rank (`receivers_at`), which is what makes the per-rank planner's cost independent of
the world size.
"""

from __future__ import annotations

import functools

from megarl.layout import ParallelLayout

ShardKey = tuple[int, int, int]  # (tp_rank, pp_rank, EVERY_EP_RANK) or (etp_rank, pp_rank, ep_rank)
EVERY_EP_RANK = -1


def is_expert_key(key: ShardKey) -> bool:
    return key[2] != EVERY_EP_RANK


def shard_keys(train: ParallelLayout, rank: int) -> tuple[ShardKey, ShardKey]:
    """The two keys of what `rank` holds: the weights every expert-parallel rank holds, and its experts."""
    c = train.coord(rank)
    return (c.tp_rank, c.pp_rank, EVERY_EP_RANK), (c.etp_rank, c.pp_rank, c.ep_rank)


def replicas_per_holder(train: ParallelLayout, key: ShardKey) -> int:
    """How many ranks hold shard `key`: dp * cp, or the expert data-parallel size for an expert shard."""
    return train.edp if is_expert_key(key) else train.dp * train.cp


def holder_rank(train: ParallelLayout, key: ShardKey, j: int) -> int:
    """The `j`-th rank holding shard `key` (replica index ascending: DP-major as `ParallelLayout.
    replicas`, or the expert data-parallel rank of an expert shard)."""
    split, pp_rank, ep_rank = key
    if is_expert_key(key):
        return train.expert_rank(split, ep_rank, j, pp_rank)
    return replica_rank(train, split, pp_rank, j)


def holder_ranks(train: ParallelLayout, key: ShardKey) -> list[int]:
    return [holder_rank(train, key, j) for j in range(replicas_per_holder(train, key))]


def replica_index(train: ParallelLayout, rank: int, expert: bool) -> int:
    """`rank`'s index among the replicas of its shard: of its expert shard if `expert`, else of its
    model shard (the `j` of `holder_rank`)."""
    c = train.coord(rank)
    return c.edp_rank if expert else c.dp_rank * train.cp + c.cp_rank


@functools.lru_cache(maxsize=1 << 16)  # a receiver asks once per segment it does not hold
def replica_major(train: ParallelLayout, rank: int, per_holder: int, expert: bool = False) -> int:
    """`rank`'s index when ranks are ordered by replica index fastest (`replica_index`, of
    `per_holder` replicas), then TP (expert TP for an expert shard), then PP."""
    c = train.coord(rank)
    split, splits = (c.etp_rank, train.etp) if expert else (c.tp_rank, train.tp)
    return replica_index(train, rank, expert) + per_holder * (split + splits * c.pp_rank)


def sender_position(train: ParallelLayout, dst: int, holders: int, per_holder: int, salt: int = 0,
                    expert: bool = False) -> int:
    """Index of the candidate (of `holders` x `per_holder`) receiver `dst` takes a slice from."""
    return (replica_major(train, dst, per_holder, expert) + salt) % (holders * per_holder)


def replica_rank(train: ParallelLayout, tp_rank: int, pp_rank: int, replica: int) -> int:
    """`train.replicas(tp_rank, pp_rank)[replica]` without building the list."""
    dp_rank, cp_rank = divmod(replica, train.cp)
    return tp_rank + train.tp * (cp_rank + train.cp * (dp_rank + train.dp * pp_rank))


def receivers_at(train: ParallelLayout, position: int, holders: int, per_holder: int,
                 salt: int = 0, expert: bool = False) -> list[int]:
    """Every training rank whose `sender_position` is `position`, ascending by shard. Cost: the
    shard positions (tp*pp, or etp*pp for experts) / holders, times ep for experts (the ep ranks of
    one position share it), independent of the data-parallel size."""
    position = (position - salt) % (holders * per_holder)
    shard, replica = divmod(position, per_holder)
    out = []
    splits = train.etp if expert else train.tp
    for split_stage in range(shard, splits * train.pp, holders):  # = split + splits * pp
        pp_rank, split = divmod(split_stage, splits)
        if expert:
            out += [train.expert_rank(split, ep_rank, replica, pp_rank) for ep_rank in range(train.ep)]
        else:
            out.append(replica_rank(train, split, pp_rank, replica))
    return out
