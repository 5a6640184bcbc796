"""A role spread over a two-node Ray cluster (head + worker node started with `ray start` on this machine).

This is the cluster shape the launch scripts build (one `ray start` per node). Each node has one
logical CPU and its own custom resource, so a 2 x 1 pool must put one rank on each node.
"""

from __future__ import annotations

import time

import psutil
import pytest
import ray
import torch
from cluster_workers import GridWorker

from megarl.cluster.local_nodes import LocalRayNodes
from megarl.cluster.ray_cluster import start_or_connect
from megarl.cluster.resource_pool import ResourcePool
from megarl.cluster.worker_group import WorkerGroup
from megarl.errors import WorkerError
from megarl.protocol import Batch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_a_role_spread_over_two_nodes_forms_one_world_and_fails_fast(tmp_path):
    ray_processes: list[psutil.Process] = []
    with LocalRayNodes([{"node_a": 1}, {"node_b": 1}], cpus_per_node=1, start_timeout_s=120) as nodes:
        for process in nodes._processes:
            ray_processes.append(psutil.Process(process.pid))
        with start_or_connect(nodes.address, wait_for_nodes=2, wait_timeout_s=120) as cluster:
            assert cluster.num_nodes == 2 and not cluster.local
            ray_processes.extend(child for p in list(ray_processes) for child in p.children(recursive=True))
            node_of = {name: node["NodeID"] for node in ray.nodes() if node["Alive"]
                       for name in ("node_a", "node_b") if name in node["Resources"]}
            assert len(set(node_of.values())) == 2

            pool = ResourcePool("spread", nnodes=2, devices_per_node=1).wait(timeout_s=120)
            assert sorted(pool.node_ids()) == sorted(node_of.values())
            group = WorkerGroup(pool, GridWorker, "actor", start_timeout_s=300)
            assert [info.node_id for info in group.node_infos] == pool.node_ids()
            assert group.node_infos[0].node_id != group.node_infos[1].node_id
            environments = group.call_all(GridWorker.environment)
            assert [env["LOCAL_RANK"] for env in environments] == ["0", "0"]  # one device per node

            group.init_distributed()  # gloo rendezvous across the two nodes at rank 0's address
            assert group.call_all(GridWorker.all_reduce_sum, 2.5) == [5.0, 5.0]
            batch = Batch.from_dict({"x": torch.tensor([1.0, 2.0, 3.0]), "row": torch.arange(3)})
            result = group.call_dp(GridWorker.affine_rows, batch, 10.0, 1.0)
            assert result["y"].tolist() == [11.0, 21.0, 31.0]
            assert result["dp_rank"].tolist() == [0, 0, 1]

            # A rank on the worker node dies while the head-node rank waits in the all_reduce.
            started = time.monotonic()
            with pytest.raises(WorkerError, match="actor rank 1 on node .* died"):
                group.call_all(GridWorker.all_reduce_or_exit, dying_rank=1, delay_s=0.5)
            assert time.monotonic() - started < 45
            group.shutdown()
            pool.shutdown()
        assert not ray.is_initialized()
    # Every process of both nodes is gone.
    _, alive = psutil.wait_procs(ray_processes, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
