"""Failures surface at once, with the role, rank and the worker's own error; pools that cannot fit fail clearly."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import ray
from cluster_workers import GridWorker

from megarl.cluster.remote_call import WorkerTimeoutError, gather
from megarl.cluster.resource_pool import PoolUnavailableError, ResourcePool
from megarl.cluster.worker_group import WorkerGroup
from megarl.errors import ConfigError, WorkerError
from megarl.trainer.workers import connect_rollout_bridge
from megarl.workers.roles import ActorRole, RolloutRole

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
    with pytest.raises(WorkerError, match=r"(?s)broken rank 1 .*constructor refused on rank 1") as caught:
        WorkerGroup(pool, GridWorker, "broken", init_kwargs={"fail_on_rank": 1}, start_timeout_s=120)
    message = str(caught.value)
    # The constructor is blamed, not the first call (node_info) that found the actor dead; the
    # worker has not reported its address yet, so the pool's node stands for it.
    assert message.startswith("broken rank 1 on node 0 of pool 'broken' failed in its constructor:\n"), message
    assert "node_info" not in message and "node node" not in message
    # The constructor's traceback, not only its last line, and without Ray's terminal colours.
    assert 'cluster_workers.py", line' in message and "in __init__" in message
    assert 'raise RuntimeError(f"constructor refused on rank {context.rank}")' in message
    assert message.rstrip().endswith("RuntimeError: constructor refused on rank 1")
    assert "\x1b[" not in message
    # The failed group gave its share of the pool back.
    cleanup(WorkerGroup(pool, GridWorker, "fixed"))


def test_gather_fails_as_soon_as_one_group_fails_while_another_still_runs(local_cluster, cleanup):
    waiting = start_pair(cleanup, "actor")
    failing = start_pair(cleanup, "rollout")
    waiting_pids = waiting.call_all(GridWorker.pid)
    failing_pids = failing.call_all(GridWorker.pid)
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        gather(waiting.call_all_async(GridWorker.sleep_interval, 3600.0),
               failing.call_all_async(GridWorker.raise_value_error, "refused", only_rank=1), timeout_s=600)
    assert time.monotonic() - started < FAST_S
    message = str(caught.value)
    assert message.startswith(f"rollout rank 1 on node {failing.node_infos[1].ip}"), message
    assert "refused (from rank 1)" in message and "actor rank" not in message
    # The failed group is stopped; the other one is left to its owner (its call is still running).
    assert_processes_gone(failing_pids)
    assert all(psutil.pid_exists(pid) for pid in waiting_pids)


class BridgeSide:
    """A role view of one pool for `connect_rollout_bridge`: the planning calls answer at once and
    connect_bridge runs `connect(group, rank)` (rank None: every rank) on the real worker group."""

    def __init__(self, group: WorkerGroup, connect) -> None:
        self.group = group
        self.connect = connect

    def call_all(self, method, *args, **kwargs):
        assert method is ActorRole.plan_bridge
        return [None] * self.group.world_size  # one layout per training rank

    def call_rank(self, rank, method, *args, **kwargs):
        assert method is ActorRole.bridge_address
        return "127.0.0.1", 1

    def call_all_async(self, method, *args, **kwargs):
        assert method is ActorRole.connect_bridge
        return self.connect(self.group, None)

    def call_rank_async(self, rank, method, *args, **kwargs):
        assert method is RolloutRole.connect_bridge
        return self.connect(self.group, rank)


def test_a_rollout_rank_failing_to_join_the_bridge_fails_at_once_naming_it(local_cluster, cleanup):
    actor = start_pair(cleanup, "hybrid_actor")
    rollout = start_pair(cleanup, "rollout")
    # The training ranks wait for the rollout ranks in the bridge's store, as they would for real.
    workers = SimpleNamespace(
        actor=BridgeSide(actor, lambda group, _: group.call_all_async(GridWorker.sleep_interval, 3600.0)),
        rollout=BridgeSide(rollout, lambda group, rank: group.call_rank_async(
            rank, GridWorker.raise_value_error, "bridge refused", only_rank=1)))
    spec = SimpleNamespace(rollout=SimpleNamespace(tensor_parallel_size=1, sync_bucket_bytes=1 << 20,
                                                   sync_verify_freq=0))
    outcome: list[BaseException] = []

    def connect() -> None:
        try:
            connect_rollout_bridge(workers, spec)
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            outcome.append(error)

    started = time.monotonic()
    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(FAST_S)
    assert not thread.is_alive(), "connect_rollout_bridge still waits on the training ranks"
    assert time.monotonic() - started < FAST_S
    [error] = outcome
    assert isinstance(error, WorkerError)
    message = str(error)
    assert message.startswith(f"rollout rank 1 on node {rollout.node_infos[1].ip}"), message
    assert "bridge refused (from rank 1)" in message and "hybrid_actor" not in message


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
