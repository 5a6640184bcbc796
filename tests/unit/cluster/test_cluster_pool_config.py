"""ResourcePool arguments, bundle shapes and role accounting (no Ray needed until wait())."""

from __future__ import annotations

import pytest

from megarl.cluster.resource_pool import ResourcePool
from megarl.cluster.worker import WorkerContext
from megarl.layout import RankCoord
from megarl.errors import ConfigError


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nnodes": 0, "devices_per_node": 1}, "nnodes must be a positive int, got 0"),
        ({"nnodes": 1, "devices_per_node": 2.0}, "devices_per_node must be a positive int"),
        ({"nnodes": 1, "devices_per_node": 1, "device": "tpu"}, r"device must be one of \('cpu', 'cuda'\)"),
        ({"nnodes": 1, "devices_per_node": 1, "cpus_per_device": 0}, "cpus_per_device must be > 0"),
        ({"nnodes": 1, "devices_per_node": 1, "max_colocate": 0}, "max_colocate must be a positive int"),
    ],
)
def test_bad_pool_arguments_name_the_pool_and_key(kwargs, message):
    with pytest.raises(ConfigError, match=f"resource pool 'p': {message}"):
        ResourcePool("p", **kwargs)


def test_cuda_bundle_holds_a_gpu_and_its_cpus_and_actors_take_their_share():
    pool = ResourcePool("actor", nnodes=2, devices_per_node=4, device="cuda", cpus_per_device=2, max_colocate=2,
                        extra_resources_per_device={"fast_net": 1})
    assert pool.world_size == 8
    assert pool.bundle() == {"CPU": 2.0, "GPU": 1.0, "fast_net": 1}
    assert pool.per_node() == {"CPU": 8.0, "GPU": 4.0, "fast_net": 4}
    assert pool.actor_resources() == {"num_cpus": 1.0, "num_gpus": 0.5, "resources": {"fast_net": 0.5}}


def test_cpu_pool_device_is_a_cpu_slot():
    pool = ResourcePool("critic", nnodes=1, devices_per_node=3, cpus_per_device=1.5)
    assert pool.bundle() == {"CPU": 1.5}
    assert pool.actor_resources() == {"num_cpus": 1.5}


def test_roles_beyond_max_colocate_are_refused_and_release_frees_a_place():
    pool = ResourcePool("shared", nnodes=1, devices_per_node=1, max_colocate=2)
    pool.claim("actor")
    pool.claim("ref")
    with pytest.raises(ConfigError, match=r"already hosts \['actor', 'ref'\]; cannot add 'critic'"):
        pool.claim("critic")
    pool.release("ref")
    pool.claim("critic")


def test_placement_before_wait_is_refused():
    with pytest.raises(Exception, match="not reserved yet: call wait"):
        ResourcePool("p", nnodes=1, devices_per_node=1).placement(0)


def test_worker_context_env_and_collect_rank():
    context = WorkerContext(role="actor", rank=5, world_size=8, local_rank=1, local_world_size=4, node_index=1,
                            master_addr="10.0.0.1", master_port=29500)
    assert context.env_vars() == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                  "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "MEGARL_ROLE": "actor"}
    assert RankCoord(rank=0, dp_rank=0, dp_size=1, pp_rank=1, pp_size=2).is_collect_rank
    assert not RankCoord(rank=0, dp_rank=0, dp_size=1, pp_rank=0, pp_size=2).is_collect_rank
    assert not RankCoord(rank=0, dp_rank=0, dp_size=1, tp_rank=1, tp_size=2).is_collect_rank
