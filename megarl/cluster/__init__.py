"""megarl.cluster: resource pools over Ray placement groups, SPMD worker groups, dispatch/collect.

Modules (import what you use; this package imports nothing heavy itself):
- ray_cluster: `start_or_connect` (local or existing cluster, cleanup on exit/Ctrl-C/SIGTERM),
  `describe_cluster`.
- resource_pool: `ResourcePool` (N nodes x D devices, one STRICT_PACK placement group per node).
- worker: `Worker` base class, `WorkerContext`; a rank's coordinates are `megarl.layout.RankCoord`.
- host_worker: `HostWorker`, several roles in the same processes (colocation).
- worker_group: `WorkerGroup` with `call_all` / `call_rank` / `call_dp` and their `_async` forms.
- remote_call: `CallHandle`, `gather`, and the failure handling every call goes through.
- dispatch: pure DP split/collect planning.
- local_nodes: `LocalRayNodes`, a multi-node cluster on one machine (`ray start`).
"""
