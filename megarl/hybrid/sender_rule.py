"""Which training rank sends a slice to a rollout rank: a rule every rank evaluates alone.

A slice that the receiver does not hold itself has candidates: the training ranks of its holding
model shards, in the plan's holder order, each shard's data/context replicas DP-major
(`ParallelLayout.replicas`), so n = holders x dp x cp candidates. Receiver `dst` takes candidate

    position(dst) = (replica_major(dst) + salt) mod n,
    replica_major = (dp * cp_size + cp) + dp*cp * (tp + tp_size * pp)

with dst's own training coordinates and `salt` the segment's ordinal in the engine parameters of
its rollout TP rank (parameter index + segment index). The replica index varies fastest, so
receivers that want the same rows from one model shard spread evenly over its replicas, and for
rows every tensor-parallel shard holds (norms) the holder follows the receiver's own TP index; the
salt makes one receiver take successive segments from successive replicas. Because the rule is arithmetic, a
sender can list its receivers without looking at any other rank (`receivers_at`), which is what
makes the per-rank planner's cost independent of the world size.
"""

from __future__ import annotations

from megarl.layout import ParallelLayout


def replica_major(train: ParallelLayout, rank: int) -> int:
    """`rank`'s index when ranks are ordered replica index fastest, then TP, then PP."""
    c = train.coord(rank)
    return (c.dp_rank * train.cp + c.cp_rank) + train.dp * train.cp * (c.tp_rank + train.tp * c.pp_rank)


def sender_position(train: ParallelLayout, dst: int, candidates: int, salt: int = 0) -> int:
    """Index of the candidate sender receiver `dst` takes a slice from (of `candidates`)."""
    return (replica_major(train, dst) + salt) % candidates


def replica_rank(train: ParallelLayout, tp_rank: int, pp_rank: int, replica: int) -> int:
    """`train.replicas(tp_rank, pp_rank)[replica]` without building the list."""
    dp_rank, cp_rank = divmod(replica, train.cp)
    return tp_rank + train.tp * (cp_rank + train.cp * (dp_rank + train.dp * pp_rank))


def receivers_at(train: ParallelLayout, position: int, holders: int, salt: int = 0) -> list[tuple[int, int, int]]:
    """(rank, tp_rank, pp_rank) of every training rank whose `sender_position` (with `salt`) is
    `position` among `holders` x dp x cp candidates, ascending by model shard. Cost: tp*pp /
    holders, independent of dp and cp."""
    replicas = train.dp * train.cp
    position = (position - salt) % (holders * replicas)
    replica, shard = position % replicas, position // replicas
    out = []
    for model_shard in range(shard, train.tp * train.pp, holders):  # model_shard = tp + tp_size * pp
        pp_rank, tp_rank = divmod(model_shard, train.tp)
        out.append((replica_rank(train, tp_rank, pp_rank, replica), tp_rank, pp_rank))
    return out
