"""Which role runs in which resource pool, as the experiment's `resources` config says.

Roles: "actor" (the hybrid worker: actor training engine + rollout engine, always together),
"ref", "critic", "reward_model". A role whose pool is null in the config shares the actor pool:

- the reference policy then lives *in the actor's processes* (HostWorker roles): it has the
  actor's architecture and parallel layout, and the hybrid worker offloads it between phases;
- the critic and the reward model then run as their own worker groups *on the actor's devices*
  (separate processes, each actor taking a share of a bundle). Megatron's parallel state is
  global to a process, so a model that may use another layout needs its own process.

A role with a pool of its own gets a separate pool (split placement).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from megarl.cluster.resource_pool import ResourcePool
from megarl.errors import ConfigError

ACTOR_POOL = "actor"
ROLES = ("actor", "ref", "critic", "reward_model")


class PoolSize(Protocol):
    nnodes: int
    devices_per_node: int


@dataclass(frozen=True)
class PoolSpec:
    name: str
    nnodes: int
    devices_per_node: int
    max_colocate: int  # worker groups (separate processes) sharing each device


@dataclass(frozen=True)
class PlacementPlan:
    """pools by name; pool_of_role[role] for every active role; whether ref is hosted by the actor."""

    pools: dict[str, PoolSpec]
    pool_of_role: dict[str, str]
    ref_in_actor_process: bool


def plan_placement(resources: Any, roles: Iterable[str]) -> PlacementPlan:
    """Pools and role placement from a `resources` config (actor_pool, critic_pool, ref_pool,
    reward_model_pool: each {nnodes, devices_per_node} or None) and the roles the run uses."""
    roles = list(dict.fromkeys(roles))
    unknown = [role for role in roles if role not in ROLES]
    if unknown or "actor" not in roles:
        raise ConfigError(f"roles must include 'actor' and be among {ROLES}, got {roles}")
    pool_of_role = {"actor": ACTOR_POOL}
    sizes: dict[str, PoolSize] = {ACTOR_POOL: resources.actor_pool}
    groups_on: dict[str, int] = {ACTOR_POOL: 1}
    ref_in_actor_process = False
    for role in roles:
        if role == "actor":
            continue
        own = getattr(resources, f"{role}_pool", None)
        if own is None:
            pool_of_role[role] = ACTOR_POOL
            if role == "ref":
                ref_in_actor_process = True
            else:
                groups_on[ACTOR_POOL] += 1
        else:
            pool_of_role[role] = role
            sizes[role] = own
            groups_on[role] = 1
    pools = {}
    for name, size in sizes.items():
        for key in ("nnodes", "devices_per_node"):
            value = getattr(size, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"resources.{name}_pool.{key} must be a positive int, got {value!r}")
        pools[name] = PoolSpec(name, size.nnodes, size.devices_per_node, groups_on[name])
    return PlacementPlan(pools=pools, pool_of_role=pool_of_role, ref_in_actor_process=ref_in_actor_process)


def resolve_device(setting: str, cluster_resources: dict[str, float]) -> str:
    """"cpu" or "cuda" for a `resources.device` of auto|cpu|cuda, given `ray.cluster_resources()`.

    auto looks at the cluster (not the driver, which may sit on a node without GPUs).
    """
    has_gpus = cluster_resources.get("GPU", 0.0) > 0
    if setting == "auto":
        return "cuda" if has_gpus else "cpu"
    if setting == "cuda" and not has_gpus:
        raise ConfigError("resources.device is 'cuda' but the Ray cluster has no GPUs; use 'cpu' or 'auto'")
    if setting not in ("cpu", "cuda"):
        raise ConfigError(f"resources.device must be auto, cpu or cuda, got {setting!r}")
    return setting


def build_pools(plan: PlacementPlan, device: str, cpus_per_device: float = 1.0) -> dict[str, ResourcePool]:
    """A (not yet reserved) ResourcePool per pool of the plan; call `wait()` on each to reserve."""
    return {
        name: ResourcePool(name, spec.nnodes, spec.devices_per_node, device=device,
                           cpus_per_device=cpus_per_device, max_colocate=spec.max_colocate)
        for name, spec in plan.pools.items()
    }
