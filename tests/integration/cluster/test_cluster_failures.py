"""Failures surface at once, with the role, rank and the worker's own error; pools that cannot fit fail clearly."""

from __future__ import annotations

import time

import psutil
import pytest
import ray
from cluster_workers import GridWorker

from megarl.cluster.remote_call import WorkerTimeoutError
from megarl.cluster.resource_pool import PoolUnavailableError, ResourcePool
from megarl.cluster.worker_group import WorkerGroup
from megarl.errors import ConfigError, WorkerError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# Generous bound for "fails fast" on a loaded 2-core machine; a hang would hit the minutes-long
# gloo timeout or never return.
FAST_S = 45.0


def start_pair(cleanup, role: str) -> WorkerGroup:
    pool = cleanup(ResourcePool(role, nnodes=1, devices_per_node=2).wait(timeout_s=60))
    group = cleanup(WorkerGroup(pool, GridWorker, role))
    group.init_distributed()
    return group


def assert_processes_gone(pids: list[int], within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"worker processes still running: {alive}")


def test_a_raising_worker_names_role_rank_node_and_its_error(local_cluster, cleanup):
    group = start_pair(cleanup, "critic")
    pids = group.call_all(GridWorker.pid)
    with pytest.raises(WorkerError) as caught:
        group.call_all(GridWorker.raise_value_error, "bad reward shape", only_rank=1)
    message = str(caught.value)
    assert "critic rank 1" in message
    assert group.node_infos[1].ip in message
    assert "ValueError" in message and "bad reward shape (from rank 1)" in message
    assert "raise_value_error" in message  # the worker's own traceback
    # The group is stopped: its processes are gone and further calls say why.
    assert_processes_gone(pids)
    with pytest.raises(WorkerError, match="stopped after an earlier failure"):
        group.call_rank(0, GridWorker.pid)


def test_worker_exiting_mid_collective_fails_the_driver_fast(local_cluster, cleanup):
    group = start_pair(cleanup, "actor")
    pids = group.call_all(GridWorker.pid)
    started = time.monotonic()
    # Rank 0 waits in an all_reduce for rank 1, which exits instead: gloo alone would wait 10 min.
    with pytest.raises(WorkerError) as caught:
        group.call_all(GridWorker.all_reduce_or_exit, dying_rank=1, delay_s=0.5)
    elapsed = time.monotonic() - started
    assert elapsed < FAST_S, elapsed
    message = str(caught.value)
    assert "actor rank 1" in message and "died" in message
    assert_processes_gone(pids)


def test_ray_kill_of_one_rank_mid_collective_fails_the_driver_fast(local_cluster, cleanup):
    group = start_pair(cleanup, "ref")
    pids = group.call_all(GridWorker.pid)
    handle = group.call_all_async(GridWorker.all_reduce_or_hang, absent_rank=1)
    time.sleep(1.0)
    assert not handle.done()
    started = time.monotonic()
    ray.kill(group.actors()[1], no_restart=True)
    with pytest.raises(WorkerError, match="ref rank 1 on node .* died"):
        handle.result(timeout_s=120)
    assert time.monotonic() - started < FAST_S
    assert_processes_gone(pids)


def test_call_timeout_names_the_ranks_still_running(local_cluster, cleanup):
    group = start_pair(cleanup, "reward")
    started = time.monotonic()
    expected = r"sleep_interval\(\) did not finish within 1.0 s on reward rank 0 .*reward rank 1"
    with pytest.raises(WorkerTimeoutError, match=expected):
        group.call_all(GridWorker.sleep_interval, 60.0, timeout_s=1.0)
    assert time.monotonic() - started < FAST_S


def test_constructor_failure_names_the_rank(local_cluster, cleanup):
    pool = cleanup(ResourcePool("broken", nnodes=1, devices_per_node=2).wait(timeout_s=60))
    with pytest.raises(WorkerError, match=r"(?s)broken rank 1 .*constructor refused on rank 1"):
        WorkerGroup(pool, GridWorker, "broken", init_kwargs={"fail_on_rank": 1}, start_timeout_s=120)
    # The failed group gave its share of the pool back.
    cleanup(WorkerGroup(pool, GridWorker, "fixed"))


def test_pool_larger_than_the_cluster_fails_at_once_saying_what_was_asked(local_cluster):
    pool = ResourcePool("huge", nnodes=2, devices_per_node=5)
    started = time.monotonic()
    with pytest.raises(PoolUnavailableError) as caught:
        pool.wait(timeout_s=300)
    assert time.monotonic() - started < 10  # does not wait for the timeout: it can never fit
    message = str(caught.value)
    assert "'huge': 2 node(s) x 5 cpu device(s)" in message and "{'CPU': 5.0}" in message
    assert "room for 1 such node(s)" in message
    assert "total {CPU: 6}" in message  # what Ray has


def test_pool_whose_resources_are_busy_fails_at_the_timeout_and_releases_them(local_cluster, cleanup):
    cleanup(ResourcePool("holder", nnodes=1, devices_per_node=4).wait(timeout_s=60))
    waiting = ResourcePool("latecomer", nnodes=1, devices_per_node=3)
    started = time.monotonic()
    with pytest.raises(PoolUnavailableError, match=r"only 0 of 1 node\(s\) could be reserved within 2.0 s") as caught:
        waiting.wait(timeout_s=2.0)
    assert 2.0 <= time.monotonic() - started < FAST_S
    assert "available {CPU: 2}" in str(caught.value)
    # Nothing of the failed reservation is left behind: 2 CPUs are still free for a new pool.
    cleanup(ResourcePool("fits", nnodes=1, devices_per_node=2).wait(timeout_s=60))


def test_a_pool_refuses_more_roles_than_max_colocate(local_cluster, cleanup):
    pool = cleanup(ResourcePool("shared", nnodes=1, devices_per_node=1, max_colocate=2).wait(timeout_s=60))
    first = cleanup(WorkerGroup(pool, GridWorker, "actor"))
    second = cleanup(WorkerGroup(pool, GridWorker, "ref"))  # same bundle, separate process, half a CPU each
    assert first.node_infos[0].pid != second.node_infos[0].pid
    with pytest.raises(ConfigError, match=r"at most 2 worker group\(s\) per device .* \['actor', 'ref'\]"):
        WorkerGroup(pool, GridWorker, "critic")
