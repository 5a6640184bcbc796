"""Hybrid engine: reshard the trained Megatron weights (TP x PP x DP x CP) into the rollout layout.

- `layout`: rank coordinates of the training layout (Megatron's order) and of the rollout layout.
- `slices`: every local tensor (Megatron shard, engine parameter) as blocks of HF tensors,
  including Megatron's and vLLM's fusion orders and vocabulary paddings.
- `plan`: `build_reshard_plan` -> who sends which slice to whom, in bounded buckets, with bytes
  accounted against the minimum.
- `executor`: `execute_plan` runs a plan with point-to-point sends (SPMD);
  `execute_plan_locally` runs it for all ranks in one process.
- `sync`: `WeightSync` / `sync_shards` connect the training engine and the rollout engine.
"""

from megarl.hybrid.executor import ExecStats, execute_plan, execute_plan_locally
from megarl.hybrid.layout import RolloutLayout, TrainLayout
from megarl.hybrid.plan import Piece, RankBytes, ReshardPlan, build_reshard_plan
from megarl.hybrid.sync import WeightSync, sync_shards

__all__ = [
    "ExecStats", "Piece", "RankBytes", "ReshardPlan", "RolloutLayout", "TrainLayout", "WeightSync",
    "build_reshard_plan", "execute_plan", "execute_plan_locally", "sync_shards",
]
