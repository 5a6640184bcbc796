"""Hybrid engine: reshard the trained Megatron weights (TP x PP x DP x CP) into the rollout layout.

Both layouts are `megarl.layout.ParallelLayout`s: the training layout in Megatron's rank order, the
rollout layout from `ParallelLayout.rollout(tp, world_size)`.

- `slices`: every local tensor (Megatron shard, engine parameter) as blocks of HF tensors,
  including Megatron's and vLLM's fusion orders and vocabulary paddings.
- `plan`: `build_reshard_plan` -> who sends which slice to whom, in bounded buckets, with bytes
  accounted against the minimum.
- `rank_plan`: `RankPlanner` -> one rank's share of a plan, at a cost independent of the world
  size, with senders by the closed-form rule of `sender_rule` (equal to its slice of
  `build_reshard_plan(..., senders="by_rank")`).
- `executor`: `execute_plan` runs a plan with point-to-point sends (SPMD);
  `execute_plan_locally` runs it for all ranks in one process.
- `sync`: `WeightSync` / `sync_shards` connect the training engine and the rollout engine.
"""

from megarl.hybrid.executor import ExecStats, execute_plan, execute_plan_locally
from megarl.hybrid.plan import Piece, RankBytes, ReshardPlan, build_reshard_plan
from megarl.hybrid.sync import WeightSync, sync_shards

__all__ = [
    "ExecStats", "Piece", "RankBytes", "ReshardPlan", "WeightSync",
    "build_reshard_plan", "execute_plan", "execute_plan_locally", "sync_shards",
]
