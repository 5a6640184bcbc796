"""Which training rank sends a slice to a rollout rank: a rule every rank evaluates alone.

A slice that the receiver does not hold itself has candidates: the training ranks of its holding
shards, in the plan's holder order, each shard's ranks DP-major (`ParallelLayout.replicas`):
n = holders x h candidates, h = dp*cp (weights every expert-parallel rank holds) or dp*cp/ep
(an expert shard: the replicas whose replica index = ep_rank mod ep). Receiver `dst` takes candidate

    position(dst) = (replica_major(dst) + salt) mod n,
    replica_major = (dp * cp_size + cp) // (dp*cp / h) + h * (tp + tp_size * pp)

with dst's own training coordinates and `salt` the segment's ordinal in the engine parameters of
its rollout TP rank (parameter index + segment index). The replica index varies fastest, so
receivers that want the same rows from one model shard spread evenly over its replicas, and for
rows every tensor-parallel shard holds (norms) the holder follows the receiver's own TP index; the
salt makes one receiver take successive segments from successive replicas. Because the rule is
arithmetic, a sender can list its receivers without looking at any other rank (`receivers_at`), which is what
makes the per-rank planner's cost independent of the world size.
"""

from __future__ import annotations

import functools

from megarl.layout import ParallelLayout

ShardKey = tuple[int, int, int]  # (tp_rank, pp_rank, ep_rank); ep_rank -1: held by every expert-parallel rank
EVERY_EP_RANK = -1


def shard_keys(train: ParallelLayout, rank: int) -> tuple[ShardKey, ShardKey]:
    """The two keys of what `rank` holds: the weights every expert-parallel rank holds, and its experts."""
    c = train.coord(rank)
    return (c.tp_rank, c.pp_rank, EVERY_EP_RANK), (c.tp_rank, c.pp_rank, c.ep_rank)


def replicas_per_holder(train: ParallelLayout, key: ShardKey) -> int:
    """How many ranks hold shard `key`: dp * cp, or dp * cp / ep for an expert shard."""
    return train.dp * train.cp // (1 if key[2] == EVERY_EP_RANK else train.ep)


def holder_rank(train: ParallelLayout, key: ShardKey, j: int) -> int:
    """The `j`-th rank holding shard `key` (replica index ascending, i.e. DP-major as
    `ParallelLayout.replicas`): replica index j, or ep_rank + ep * j for an expert shard."""
    tp_rank, pp_rank, ep_rank = key
    return replica_rank(train, tp_rank, pp_rank, j if ep_rank == EVERY_EP_RANK else ep_rank + train.ep * j)


def holder_ranks(train: ParallelLayout, key: ShardKey) -> list[int]:
    return [holder_rank(train, key, j) for j in range(replicas_per_holder(train, key))]


@functools.lru_cache(maxsize=1 << 16)  # a receiver asks once per segment it does not hold
def replica_major(train: ParallelLayout, rank: int, per_holder: int) -> int:
    """`rank`'s index when ranks are ordered by replica group fastest, then TP, then PP; a replica
    group is the dp*cp / `per_holder` consecutive replica indices that one candidate stands for."""
    c = train.coord(rank)
    replica = c.dp_rank * train.cp + c.cp_rank
    return replica // (train.dp * train.cp // per_holder) + per_holder * (c.tp_rank + train.tp * c.pp_rank)


def sender_position(train: ParallelLayout, dst: int, holders: int, per_holder: int, salt: int = 0) -> int:
    """Index of the candidate (of `holders` x `per_holder`) receiver `dst` takes a slice from."""
    return (replica_major(train, dst, per_holder) + salt) % (holders * per_holder)


def replica_rank(train: ParallelLayout, tp_rank: int, pp_rank: int, replica: int) -> int:
    """`train.replicas(tp_rank, pp_rank)[replica]` without building the list."""
    dp_rank, cp_rank = divmod(replica, train.cp)
    return tp_rank + train.tp * (cp_rank + train.cp * (dp_rank + train.dp * pp_rank))


def receivers_at(train: ParallelLayout, position: int, holders: int, per_holder: int,
                 salt: int = 0) -> list[tuple[int, ShardKey]]:
    """(rank, its expert shard key) of every training rank whose `sender_position` is `position`,
    ascending by model shard. Cost: tp*pp / holders x the replica group size, independent of the
    data-parallel size for weights every rank of a model shard holds."""
    group = train.dp * train.cp // per_holder
    position = (position - salt) % (holders * per_holder)
    first, shard = position % per_holder * group, position // per_holder
    out = []
    for model_shard in range(shard, train.tp * train.pp, holders):  # model_shard = tp + tp_size * pp
        pp_rank, tp_rank = divmod(model_shard, train.tp)
        for replica in range(first, first + group):
            out.append((replica_rank(train, tp_rank, pp_rank, replica), (tp_rank, pp_rank, replica % train.ep)))
    return out
