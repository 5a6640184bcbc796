"""Start the SPMD worker groups of an experiment on Ray and return one handle per role.

Placement follows `resources`: the hybrid actor (actor + rollout, and the reference unless it has
its own pool) takes `resources.actor_pool`; the critic shares the actor's processes when it has no
pool of its own and the same Megatron layout, otherwise it takes `resources.critic_pool`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from megarl.cluster.host_worker import HostWorker
from megarl.cluster.resource_pool import ResourcePool
from megarl.cluster.worker import ParallelInfo
from megarl.cluster.worker_group import RoleView, WorkerGroup
from megarl.config import critic_enabled, ref_enabled
from megarl.config.validate import role_parallel
from megarl.workers.roles import ActorRole, CriticRole, RefRole, RolloutRole

logger = logging.getLogger(__name__)


@dataclass
class Workers:
    actor: RoleView
    rollout: RoleView
    rollout_infos: list[ParallelInfo]
    ref: Optional[RoleView] = None
    critic: Optional[RoleView] = None
    groups: list[WorkerGroup] = field(default_factory=list)
    rollout_engine: str = ""

    def shutdown(self) -> None:
        for group in self.groups:
            group.shutdown()


def _device(cfg: DictConfig) -> str:
    if cfg.resources.device != "auto":
        return cfg.resources.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _layout_dict(par: Any) -> dict[str, int]:
    return {
        "tp": par.tensor_model_parallel_size,
        "pp": par.pipeline_model_parallel_size,
        "cp": par.context_parallel_size,
        "ep": par.expert_model_parallel_size,
    }


def rollout_parallel_infos(world_size: int, rollout_tp: int) -> list[ParallelInfo]:
    """Dispatch coordinates of the rollout layout: consecutive ranks form one rollout TP group."""
    dp = world_size // rollout_tp
    return [ParallelInfo(rank=r, dp_rank=r // rollout_tp, dp_size=dp, tp_rank=r % rollout_tp, tp_size=rollout_tp)
            for r in range(world_size)]


def _pool(name: str, pool_cfg: Any, device: str, cpus: float) -> ResourcePool:
    return ResourcePool(name, nnodes=int(pool_cfg.nnodes), devices_per_node=int(pool_cfg.devices_per_node),
                        device=device, cpus_per_device=cpus)


def start_workers(cfg: DictConfig, model_dir: str, tokenizer: Any, total_steps: int) -> Workers:
    """Create pools and worker groups, initialise process groups, engines and weights."""
    device = _device(cfg)
    res = cfg.resources
    cpus = float(res.num_cpus_per_worker)
    config = OmegaConf.to_container(cfg, resolve=True)
    role_kwargs = {"config": config, "model_dir": str(model_dir), "total_steps": total_steps}
    use_ref = ref_enabled(cfg)
    use_critic = critic_enabled(cfg)
    critic_colocated = use_critic and res.critic_pool is None  # layouts checked by validate_config
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    hybrid_roles: dict[str, tuple[type, dict[str, Any]]] = {
        "actor": (ActorRole, role_kwargs),
        "rollout": (RolloutRole, {"config": config, "model_dir": str(model_dir), "pad_token_id": int(pad),
                                  "eos_token_ids": [int(eos)]}),
    }
    if use_ref and res.ref_pool is None:
        hybrid_roles["ref"] = (RefRole, role_kwargs)
    if critic_colocated:
        hybrid_roles["critic"] = (CriticRole, role_kwargs)

    groups: list[WorkerGroup] = []
    try:
        hybrid = WorkerGroup(_pool("actor", res.actor_pool, device, cpus), HostWorker, "hybrid_actor",
                             init_kwargs={"roles": hybrid_roles})
        groups.append(hybrid)
        hybrid.init_distributed(layout=_layout_dict(cfg.actor.megatron))
        init = [hybrid.for_role(name).call_all_async("init_model") for name in hybrid_roles if name != "rollout"]
        for handle in init:
            handle.result()
        engines = hybrid.for_role("rollout").call_all("init_engine")
        workers = Workers(
            actor=hybrid.for_role("actor"),
            rollout=hybrid.for_role("rollout"),
            rollout_infos=rollout_parallel_infos(hybrid.world_size, int(cfg.rollout.tensor_model_parallel_size)),
            groups=groups,
            rollout_engine=engines[0],
        )
        if "ref" in hybrid_roles:
            workers.ref = hybrid.for_role("ref")
        if critic_colocated:
            workers.critic = hybrid.for_role("critic")
        for name, pool_cfg, role_cls, section in (
            ("ref", res.ref_pool, RefRole, "ref"),
            ("critic", res.critic_pool, CriticRole, "critic"),
        ):
            wanted = use_ref if name == "ref" else use_critic
            if not wanted or pool_cfg is None:
                continue
            group = WorkerGroup(_pool(name, pool_cfg, device, cpus), HostWorker, name,
                                init_kwargs={"roles": {name: (role_cls, role_kwargs)}})
            groups.append(group)
            group.init_distributed(layout=_layout_dict(role_parallel(cfg, section)))
            group.for_role(name).call_all("init_model")
            setattr(workers, name, group.for_role(name))
        logger.info("workers ready: %s; rollout engine %s", ", ".join(repr(g) for g in groups), workers.rollout_engine)
        return workers
    except BaseException:
        for group in groups:
            group.shutdown()
        raise
