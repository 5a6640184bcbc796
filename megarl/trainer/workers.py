"""Start the SPMD worker groups of an experiment on Ray and return one handle per role.

Placement follows `resources`: the hybrid actor (actor + rollout, and the reference unless it has
its own pool) takes `resources.actor_pool`; the rollout engines take `resources.rollout_pool` when
it is set (separate placement, weights over a bridge between the pools: `megarl.hybrid.bridge`).
The critic runs in the actor's processes when `resources.critic_pool` is null (with the actor's
Megatron layout: the config check refuses another), else in that pool; so does the reward model
(`resources.reward_model_pool`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from megarl.cluster.host_worker import HostWorker
from megarl.cluster.remote_call import gather
from megarl.cluster.resource_pool import ResourcePool
from megarl.cluster.worker_group import RoleView, WorkerGroup
from megarl.layout import ParallelLayout, RankCoord
from megarl.trainer.run_spec import RunSpec
from megarl.workers.roles import ActorRole, CriticRole, RefRole, RewardModelRole, RolloutRole
from megarl.workers.specs import EngineRoleSpec

logger = logging.getLogger(__name__)


@dataclass
class Workers:
    actor: RoleView
    rollout: RoleView
    rollout_coords: list[RankCoord]  # dispatch of generation: one DP shard per rollout engine
    hybrid: WorkerGroup  # the processes of actor + rollout (+ colocated ref / critic)
    ref: Optional[RoleView] = None
    critic: Optional[RoleView] = None
    reward_model: Optional[RoleView] = None
    groups: list[WorkerGroup] = field(default_factory=list)
    rollout_engine: str = ""
    separate_rollout: bool = False  # the rollout engines have a pool of their own (resources.rollout_pool)

    def shutdown(self) -> None:
        for group in self.groups:
            group.shutdown()


def _device(cfg: DictConfig) -> str:
    if cfg.resources.device != "auto":
        return cfg.resources.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def rollout_coords(world_size: int, rollout_tp: int) -> list[RankCoord]:
    """Dispatch coordinates of the rollout layout: consecutive ranks form one rollout TP group."""
    layout = ParallelLayout.rollout(rollout_tp, world_size)
    return [layout.coord(r) for r in range(world_size)]


def _pool(name: str, pool_cfg: Any, device: str, cpus: float) -> ResourcePool:
    return ResourcePool(name, nnodes=int(pool_cfg.nnodes), devices_per_node=int(pool_cfg.devices_per_node),
                        device=device, cpus_per_device=cpus)


def connect_rollout_bridge(workers: Workers, spec: RunSpec) -> None:
    """Separate placement: each training rank plans what its rollout rank receives, and both pools
    join one gloo group (the bridge) that the weight syncs run over."""
    ro = spec.rollout
    layouts = workers.actor.call_all(ActorRole.plan_bridge, ro.tensor_parallel_size, ro.sync_bucket_bytes,
                                     ro.sync_verify_freq)
    host, port = workers.actor.call_rank(0, ActorRole.bridge_address)
    size = 2 * len(layouts)
    sending = workers.actor.call_all_async(ActorRole.connect_bridge, host, port, size)
    receiving = [workers.rollout.call_rank_async(rank, RolloutRole.connect_bridge, host, port, size, layout)
                 for rank, layout in enumerate(layouts)]
    # Both sides together: a rank of either pool that fails leaves the other pool's ranks waiting
    # in the bridge's store (10 min), so waiting on one side first would report it then, blaming them.
    gather(sending, *receiving)
    logger.info("rollout bridge: %d training ranks -> %d rollout ranks over gloo at %s:%d", len(layouts),
                len(layouts), host, port)


def start_workers(cfg: DictConfig, spec: RunSpec) -> Workers:
    """Create pools and worker groups, initialise process groups, engines and weights.

    `cfg.resources` says where roles run; `spec` is what each role is built with.
    """
    device = _device(cfg)
    res = cfg.resources
    cpus = float(res.num_cpus_per_worker)
    separate_rollout = res.rollout_pool is not None
    hybrid_roles: dict[str, tuple[type, dict[str, Any]]] = {"actor": (ActorRole, {"spec": spec.actor})}
    if not separate_rollout:
        hybrid_roles["rollout"] = (RolloutRole, {"spec": spec.rollout})
    if spec.ref is not None and res.ref_pool is None:
        hybrid_roles["ref"] = (RefRole, {"spec": spec.ref})
    if spec.critic is not None and res.critic_pool is None:  # same layout: checked by validate_config
        hybrid_roles["critic"] = (CriticRole, {"spec": spec.critic})
    if spec.reward_model is not None and res.reward_model_pool is None:  # same layout: checked by validate_config
        hybrid_roles["reward_model"] = (RewardModelRole, {"spec": spec.reward_model})

    groups: list[WorkerGroup] = []
    try:
        hybrid = WorkerGroup(_pool("actor", res.actor_pool, device, cpus), HostWorker, "hybrid_actor",
                             init_kwargs={"roles": hybrid_roles})
        groups.append(hybrid)
        hybrid.init_distributed(layout=spec.actor.layout)
        init = [hybrid.for_role(name).call_all_async(cls.init_model)
                for name, (cls, _) in hybrid_roles.items() if name != "rollout"]
        for handle in init:
            handle.result()
        rollout_group = hybrid
        if separate_rollout:
            rollout_group = WorkerGroup(_pool("rollout", res.rollout_pool, device, cpus), HostWorker, "rollout",
                                        init_kwargs={"roles": {"rollout": (RolloutRole, {"spec": spec.rollout})}})
            groups.append(rollout_group)
            rollout_group.init_distributed()
        engines = rollout_group.for_role("rollout").call_all(RolloutRole.init_engine)
        workers = Workers(
            actor=hybrid.for_role("actor"),
            rollout=rollout_group.for_role("rollout"),
            rollout_coords=rollout_coords(rollout_group.world_size, spec.rollout.tensor_parallel_size),
            hybrid=hybrid,
            groups=groups,
            rollout_engine=engines[0],
            separate_rollout=separate_rollout,
        )
        if separate_rollout:
            connect_rollout_bridge(workers, spec)
        if "ref" in hybrid_roles:
            workers.ref = hybrid.for_role("ref")
        if "critic" in hybrid_roles:
            workers.critic = hybrid.for_role("critic")
        if "reward_model" in hybrid_roles:
            workers.reward_model = hybrid.for_role("reward_model")
        own_pools: list[tuple[Any, type, Optional[EngineRoleSpec]]] = [
            (res.ref_pool, RefRole, spec.ref), (res.critic_pool, CriticRole, spec.critic),
            (res.reward_model_pool, RewardModelRole, spec.reward_model)]
        for pool_cfg, role_cls, role_spec in own_pools:
            if role_spec is None or pool_cfg is None:
                continue
            name = role_spec.name
            group = WorkerGroup(_pool(name, pool_cfg, device, cpus), HostWorker, name,
                                init_kwargs={"roles": {name: (role_cls, {"spec": role_spec})}})
            groups.append(group)
            group.init_distributed(layout=role_spec.layout)
            group.for_role(name).call_all(role_cls.init_model)
            setattr(workers, name, group.for_role(name))
        logger.info("workers ready: %s; rollout engine %s", ", ".join(repr(g) for g in groups), workers.rollout_engine)
        return workers
    except BaseException:
        for group in groups:
            group.shutdown()
        raise
