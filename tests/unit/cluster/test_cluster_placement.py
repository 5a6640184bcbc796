"""Role -> pool placement from the resources config (pure)."""

from __future__ import annotations

import pytest

from megarl.cluster.placement import build_pools, plan_placement, resolve_device
from megarl.config.schema import PoolConfig, ResourcesConfig
from megarl.errors import ConfigError


def test_everything_colocated_by_default():
    plan = plan_placement(ResourcesConfig(actor_pool=PoolConfig(1, 4)), ["actor", "ref", "critic", "reward_model"])
    assert plan.pool_of_role == {"actor": "actor", "ref": "actor", "critic": "actor", "reward_model": "actor"}
    assert plan.ref_in_actor_process
    # actor (hosting ref) + critic + reward model: three groups of processes share each device.
    assert list(plan.pools) == ["actor"] and plan.pools["actor"].max_colocate == 3


def test_split_placement_gives_separate_pools():
    resources = ResourcesConfig(actor_pool=PoolConfig(2, 8), critic_pool=PoolConfig(1, 4), ref_pool=PoolConfig(1, 2))
    plan = plan_placement(resources, ["actor", "ref", "critic"])
    assert plan.pool_of_role == {"actor": "actor", "ref": "ref", "critic": "critic"}
    assert not plan.ref_in_actor_process
    assert {name: (p.nnodes, p.devices_per_node, p.max_colocate) for name, p in plan.pools.items()} == {
        "actor": (2, 8, 1), "ref": (1, 2, 1), "critic": (1, 4, 1)}
    pools = build_pools(plan, "cpu", cpus_per_device=2)
    assert pools["actor"].world_size == 16 and pools["critic"].bundle() == {"CPU": 2.0}


def test_bad_roles_and_sizes_are_refused():
    with pytest.raises(ConfigError, match="must include 'actor'"):
        plan_placement(ResourcesConfig(), ["critic"])
    with pytest.raises(ConfigError, match="among"):
        plan_placement(ResourcesConfig(), ["actor", "judge"])
    with pytest.raises(ConfigError, match=r"resources.critic_pool.nnodes must be a positive int, got 0"):
        plan_placement(ResourcesConfig(critic_pool=PoolConfig(0, 1)), ["actor", "critic"])


def test_device_resolution_looks_at_the_cluster():
    assert resolve_device("auto", {"CPU": 4.0}) == "cpu"
    assert resolve_device("auto", {"CPU": 4.0, "GPU": 8.0}) == "cuda"
    with pytest.raises(ConfigError, match="no GPUs"):
        resolve_device("cuda", {"CPU": 4.0})
    with pytest.raises(ConfigError, match="auto, cpu or cuda"):
        resolve_device("tpu", {})
