"""Hybrid engine: reshard the trained Megatron weights (TP x PP x DP x CP) into the rollout layout.

Both layouts are `megarl.layout.ParallelLayout`s: the training layout in Megatron's rank order, the
rollout layout from `ParallelLayout.rollout(tp, world_size)`.

- `slices`: every local tensor (Megatron shard, engine parameter) as blocks of HF tensors,
  including Megatron's and vLLM's fusion orders and vocabulary paddings.
- `plan`: `ReshardPlan` -> who sends which slice to whom, in bounded buckets, with bytes
  accounted against the minimum, for the ranks it covers; `build_reshard_plan` plans the whole
  world on one rank (tests, `megarl sync plan`).
- `rank_plan`: `RankPlanner` -> one rank's own plan, at a cost independent of the world size,
  with senders by the closed-form rule of `sender_rule` (equal to its slice of
  `build_reshard_plan(..., senders="by_rank")`; the union of all ranks' plans is that plan).
- `executor`: `execute_plan` runs a plan that covers the calling rank with point-to-point sends
  (SPMD); `execute_plan_locally` runs a whole-world plan for all ranks in one process.
- `sync`: `WeightSync` (each rank's own plan) / `sync_shards` connect the training engine and
  the rollout engine.

Each is imported from its module: this package imports nothing itself, so that `megarl sync plan --help`
starts without torch.
"""
