"""Worker groups: one Ray actor per rank of a role, and explicit dispatch at the call site.

    pool = ResourcePool("actor", nnodes=1, devices_per_node=4).wait(timeout_s=60)
    actor = WorkerGroup(pool, HostWorker, "hybrid", init_kwargs={"roles": {...}})
    actor.init_distributed(layout={"tp": 2})             # every rank, returns RankCoords
    out = actor.for_role("actor").call_dp(ActorRole.compute_log_prob, batch)  # split over DP, collect
    actor.call_all(HostWorker.set_active, ["actor"])      # broadcast, one result per rank
    handle = critic.call_dp_async(CriticRole.update_critic, batch)  # runs while the driver goes on
    values = handle.result(timeout_s=600)

Calls name the method itself (a function of the worker class, or of the role class for a role
view), so a reader can follow a call from the driver into the worker; the group checks that the
target really has that method before anything is sent. Where data goes is written at the call: `call_dp` splits a Batch over the data-parallel ranks
(padding B to a multiple of DP and dropping the padding from the result; ranks of the same DP
group get the same shard) and collects from the last pipeline stage / TP rank 0 / CP rank 0 of
each DP group, in DP order. `call_all` broadcasts; `call_rank` targets one rank. Each has an
`_async` variant returning a `CallHandle`; `remote_call.gather` waits on handles of several
groups together.

Failure handling: any call whose rank raises or dies raises `WorkerError` naming the role, rank
and node, with the worker's traceback, as soon as that rank fails (not when the others finish);
by default the whole group is then killed, since its other ranks are typically blocked in a
collective that can never complete.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.actor import ActorClass, ActorHandle
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl.cluster.dispatch import (
    DispatchError,
    merge_data_parallel_results,
    plan_dispatch,
    split_for_data_parallel,
)
from megarl.cluster.ray_cluster import register_for_cleanup, unregister_for_cleanup
from megarl.cluster.remote_call import CallHandle, RankCall
from megarl.cluster.rendezvous import node_address_and_free_port
from megarl.cluster.resource_pool import ResourcePool
from megarl.cluster.worker import NodeInfo, Worker, WorkerContext
from megarl.errors import WorkerError
from megarl.layout import RankCoord
from megarl.protocol import Batch

logger = logging.getLogger(__name__)
Method = Callable[..., Any]  # a function defined in the worker class or in a hosted role's class

# torch's CPU allocator, with THP_MEM_ALLOC_ENABLE=1 in the environment, aligns every allocation of
# 2 MiB or more to a huge page and asks the kernel for transparent huge pages there (madvise): a
# fresh activation or gradient tensor then faults in 2 MiB at a time instead of 4 KiB, and large
# operands take fewer TLB entries (the kernel may still refuse: transparent_hugepage `never`).
# torch reads the variable once per process, so it is in a worker's environment from the start.
# Measured on a ~25M-parameter CPU run: benchmarks/HISTORY.md.
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def worker_env(device: str, num_cpus: float, env: dict[str, str]) -> dict[str, str]:
    """Environment variables every worker of a group starts with (before the torchrun-style rank
    variables): OpenMP threads = the CPUs each actor holds, torch's huge-page allocation on CPU
    (`HUGE_PAGES_ENV`; the driver's own value of the variable, 0 included, when it has one),
    then the caller's `env`, which wins."""
    defaults = {"OMP_NUM_THREADS": str(max(1, int(num_cpus)))}
    if HUGE_PAGES_ENV in os.environ:
        defaults[HUGE_PAGES_ENV] = os.environ[HUGE_PAGES_ENV]
    elif device == "cpu":
        defaults[HUGE_PAGES_ENV] = "1"
    return {**defaults, **env}


def method_name(method: Method, target: type, where: str) -> str:
    """The name `method` is called by on an instance of `target`, checked: `method` must be what
    `target` has under that name (its own or inherited), e.g. `ActorRole.compute_log_prob`."""
    name = getattr(method, "__name__", None)
    if not callable(method) or name is None:
        raise TypeError(f"{where}: a call names the method itself (e.g. ActorRole.compute_log_prob), got {method!r}")
    if getattr(target, name, None) is not method:
        raise TypeError(f"{where}: {getattr(method, '__qualname__', name)} is not a method of {target.__name__}")
    return name


class _Calls:
    """The call API, shared by a whole group and by the view of one role hosted in it."""

    def _target(self) -> tuple[WorkerGroup, str | None]:
        raise NotImplementedError

    def call_all_async(self, method: Method, *args: Any, **kwargs: Any) -> CallHandle:
        """Run `method(*args, **kwargs)` on every rank; the handle gives one result per rank."""
        group, role = self._target()
        return group._submit(range(group.world_size), role, method, [(args, kwargs)] * group.world_size, list)

    def call_all(self, method: Method, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Blocking `call_all_async`: the list of every rank's result, in rank order."""
        return self.call_all_async(method, *args, **kwargs).result(self._timeout(timeout_s))

    def call_rank_async(self, rank: int, method: Method, *args: Any, **kwargs: Any) -> CallHandle:
        """Run `method` on one rank only; the handle gives its result."""
        group, role = self._target()
        if not 0 <= rank < group.world_size:
            raise ValueError(f"{group.role}: rank {rank} outside world size {group.world_size}")
        return group._submit([rank], role, method, [(args, kwargs)], lambda results: results[0])

    def call_rank(self, rank: int, method: Method, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        return self.call_rank_async(rank, method, *args, **kwargs).result(self._timeout(timeout_s))

    def call_dp_async(
        self, method: Method, batch: Batch, *args: Any, dispatch_coords: Sequence[RankCoord] | None = None, **kwargs: Any
    ) -> CallHandle:
        """Split `batch` over the DP ranks and run `method(shard, *args, **kwargs)` on every rank.

        The handle's result merges the collect ranks' results in DP order (Batches and tensors
        concatenated with the padding rows removed, so row i of the result belongs to row i of
        `batch`; None if all are None; otherwise the list of per-DP-rank results).
        `dispatch_coords` replaces the group's training layout for this call, e.g. with the rollout
        layout (rollout TP groups instead of Megatron's TP x PP x CP).
        """
        group, role = self._target()
        coords = group.rank_coords if dispatch_coords is None else dispatch_coords
        if len(coords) != group.world_size:
            # Checked before anything is sent: too few coordinates would fail on a missing rank
            # here, too many only once the work had run, on a collect rank the group lacks.
            raise DispatchError(f"{group.role}: dispatch_coords has {len(coords)} rank coordinate(s) but the "
                                f"group has world size {group.world_size}: one per rank is needed")
        plan = plan_dispatch(coords)
        shards, pad = split_for_data_parallel(batch, plan.dp_size)
        # A shard that several ranks take (the TP/PP/CP ranks of one DP group) goes to the object
        # store once; one that a single rank takes travels in its call (Ray inlines a small argument
        # and stores a large one itself). A put costs more than the call on a small batch: a 2-rank
        # call with a quickstart-sized shard each took 5.9-7.9 ms with a put per shard, 2.3-2.7 inlined.
        takers = Counter(plan.shard_of_rank[rank] for rank in range(group.world_size))
        shard_args = [ray.put(shard) if takers[i] > 1 else shard for i, shard in enumerate(shards)]
        per_rank_args = [((shard_args[plan.shard_of_rank[rank]], *args), kwargs) for rank in range(group.world_size)]

        def finish(results: list[Any]) -> Any:
            return merge_data_parallel_results([results[rank] for rank in plan.collect_ranks], pad,
                                               method=getattr(method, "__qualname__", str(method)))

        return group._submit(range(group.world_size), role, method, per_rank_args, finish)

    def call_dp(
        self,
        method: Method,
        batch: Batch,
        *args: Any,
        timeout_s: float | None = None,
        dispatch_coords: Sequence[RankCoord] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Blocking `call_dp_async`."""
        handle = self.call_dp_async(method, batch, *args, dispatch_coords=dispatch_coords, **kwargs)
        return handle.result(self._timeout(timeout_s))

    def _timeout(self, timeout_s: float | None) -> float | None:
        group, _ = self._target()
        return group.call_timeout_s if timeout_s is None else timeout_s


class RoleView(_Calls):
    """Calls routed to one role object inside the group's `HostWorker`s."""

    def __init__(self, group: WorkerGroup, role: str) -> None:
        self.group = group
        self.name = role

    def _target(self) -> tuple[WorkerGroup, str | None]:
        return self.group, self.name

    def __repr__(self) -> str:
        return f"RoleView({self.group.role!r}/{self.name!r})"


class WorkerGroup(_Calls):
    """One actor of `worker_cls` per rank of `pool`; `worker_cls(context, **init_kwargs)` each.

    env: extra environment variables for the worker processes (added to `worker_env`'s).
    call_timeout_s: default timeout of blocking calls (None: wait for ever). kill_on_failure: kill
    every rank when one fails or a call times out (default).
    """

    def __init__(
        self,
        pool: ResourcePool,
        worker_cls: type[Worker],
        role: str,
        init_kwargs: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        pool_timeout_s: float = 60.0,
        start_timeout_s: float = 300.0,
        call_timeout_s: float | None = None,
        kill_on_failure: bool = True,
    ) -> None:
        if isinstance(worker_cls, ActorClass):
            raise TypeError(f"{role}: pass the plain worker class, not a ray.remote class")
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"{role}: worker class must subclass megarl.cluster.worker.Worker, got {worker_cls!r}")
        self.pool = pool
        self.role = role
        self.worker_cls = worker_cls
        # Role classes hosted in each process (HostWorker's `roles`), for checking role calls.
        self.role_classes: dict[str, type] = {name: cls for name, (cls, _) in (init_kwargs or {}).get("roles", {}).items()}
        self.call_timeout_s = call_timeout_s
        self.kill_on_failure = kill_on_failure
        self._failure: str | None = None
        self._actors: list[ActorHandle] = []
        # Calls sent so far (one per rank and method): the trainer probes a group's memory after a
        # phase only if the phase sent it something.
        self.calls_sent = 0
        pool.wait(pool_timeout_s)
        pool.claim(role)
        register_for_cleanup(self)
        try:
            self._start(worker_cls, init_kwargs or {}, env or {}, start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    def _start(
        self, worker_cls: type[Worker], init_kwargs: dict[str, Any], env: dict[str, str], timeout_s: float
    ) -> None:
        first = self.pool.placement(0)
        rendezvous = node_address_and_free_port.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(first.placement_group, first.bundle_index)
        ).remote()
        master_addr, master_port = ray.get(rendezvous, timeout=timeout_s)
        options = self.pool.actor_resources()
        env_vars = worker_env(self.pool.device, options["num_cpus"], env)
        remote_cls = ray.remote(worker_cls)
        for rank in range(self.world_size):
            placement = self.pool.placement(rank)
            context = WorkerContext(
                role=self.role,
                rank=rank,
                world_size=self.world_size,
                local_rank=placement.local_rank,
                local_world_size=self.pool.devices_per_node,
                node_index=placement.node_index,
                master_addr=master_addr,
                master_port=master_port,
                device=self.pool.device,
            )
            actor = remote_cls.options(
                **options,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement.placement_group, placement.bundle_index),
                runtime_env={"env_vars": {**env_vars, **context.env_vars()}},
                max_restarts=0,
                max_task_retries=0,
            ).remote(context, **init_kwargs)
            self._actors.append(actor)
        # Until a worker reports its node, messages ("... on node <label>") name the pool's node.
        self._node_labels = [f"{self.pool.placement(rank).node_index} of pool {self.pool.name!r}"
                             for rank in range(self.world_size)]
        self.node_infos: list[NodeInfo] = self._submit(
            range(self.world_size), None, worker_cls.node_info, [((), {})] * self.world_size, list
        ).result(timeout_s)
        self._node_labels = [f"{info.ip} (host {info.hostname}, node {info.node_id[:8]}, pid {info.pid})"
                             for info in self.node_infos]
        self.rank_coords: list[RankCoord] = [
            RankCoord.data_parallel_only(rank, self.world_size) for rank in range(self.world_size)
        ]

    def for_role(self, name: str) -> RoleView:
        """Calls to the role object `name` hosted in this group's HostWorkers."""
        return RoleView(self, name)

    def _target(self) -> tuple[WorkerGroup, str | None]:
        return self, None

    def init_distributed(self, timeout_s: float | None = None, **kwargs: Any) -> list[RankCoord]:
        """Call every rank's `init_distributed(**kwargs)` and keep the RankCoords it returns.

        Dispatch (`call_dp`) uses these from then on. An engine that builds its groups in another
        method must call `refresh_rank_coords()` afterwards.
        """
        infos = self.call_all(self.worker_cls.init_distributed, timeout_s=timeout_s, **kwargs)
        self._set_rank_coords(infos)
        return infos

    def refresh_rank_coords(self, timeout_s: float | None = None) -> list[RankCoord]:
        """Ask every rank for its current `rank_coord()` and use it for dispatch."""
        infos = self.call_all(self.worker_cls.rank_coord, timeout_s=timeout_s)
        self._set_rank_coords(infos)
        return infos

    def _set_rank_coords(self, infos: list[RankCoord]) -> None:
        plan_dispatch(infos)  # reject an inconsistent layout now rather than at the first call_dp
        self.rank_coords = infos

    def _submit(
        self,
        ranks: Sequence[int] | range,
        role: str | None,
        method: Method,
        per_rank_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
        finish: Any,
    ) -> CallHandle:
        """Send `method` to `ranks` (args per rank) and return the handle that waits for them."""
        if self._failure is not None:
            raise WorkerError(f"{self.role}: the worker group was stopped after an earlier failure:\n{self._failure}")
        if not self._actors:
            raise WorkerError(f"{self.role}: the worker group has been shut down")
        if role is None:
            name = method_name(method, self.worker_cls, self.role)
        else:
            if role not in self.role_classes:
                raise KeyError(f"{self.role}: hosts roles {sorted(self.role_classes)}, not {role!r}")
            name = method_name(method, self.role_classes[role], f"{self.role}/{role}")
        calls = []
        label = name if role is None else f"{role}.{name}"
        for rank, (args, kwargs) in zip(ranks, per_rank_args):
            actor = self._actors[rank]
            if role is None:
                ref = getattr(actor, name).remote(*args, **kwargs)
            else:
                ref = actor.call.remote(role, name, *args, **kwargs)
            calls.append(RankCall(self.role, rank, self._node_labels[rank], label, ref))
        self.calls_sent += len(calls)
        return CallHandle(calls, finish, self._on_failure if self.kill_on_failure else None)

    def _on_failure(self) -> None:
        if self._failure is None:
            self._failure = "one of its ranks failed or timed out (see the WorkerError raised then)"
        logger.error("%s: killing all %d ranks after a failure", self.role, self.world_size)
        self._kill_actors()

    def _kill_actors(self) -> None:
        if not ray.is_initialized():
            return
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass

    def shutdown(self) -> None:
        """Kill every rank and give the group's share of the pool back (safe to call twice)."""
        self._kill_actors()
        self._actors = []
        self.pool.release(self.role)
        unregister_for_cleanup(self)

    def actors(self) -> list[ActorHandle]:
        """The Ray actor handles, in rank order (for tests and tools; prefer the call API)."""
        return list(self._actors)

    def __repr__(self) -> str:
        return f"WorkerGroup({self.role!r}, world_size={self.world_size}, pool={self.pool.name!r})"

