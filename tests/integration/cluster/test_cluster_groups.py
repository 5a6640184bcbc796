"""Worker groups on a local Ray cluster: rank context, gloo world, dispatch/collect, concurrency."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from cluster_workers import VOCAB, GridWorker, TinyPolicy, TinySampler

from megarl.cluster.dispatch import DispatchError
from megarl.cluster.host_worker import HostWorker
from megarl.cluster.remote_call import gather
from megarl.cluster.resource_pool import ResourcePool
from megarl.cluster.worker_group import HUGE_PAGES_ENV, WorkerGroup
from megarl.layout import RankCoord
from megarl.protocol import Batch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def grid4(local_cluster):
    """A 4-rank group (1 node x 4 CPU slots) with its gloo world formed."""
    pool = ResourcePool("grid", nnodes=1, devices_per_node=4).wait(timeout_s=120)
    group = WorkerGroup(pool, GridWorker, "grid", init_kwargs={"tag": "g"}, env={"MEGARL_TEST_FLAG": "on"})
    group.init_distributed()
    yield group
    group.shutdown()
    pool.shutdown()


def numbered_batch(rows: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(rows, dtype=torch.float32) * 0.5 - 1.0,
                            "row": torch.arange(rows)})


def test_each_rank_gets_its_context_and_the_ranks_form_one_gloo_world(grid4):
    environments = grid4.call_all(GridWorker.environment)
    assert [env["RANK"] for env in environments] == ["0", "1", "2", "3"]
    assert {env["WORLD_SIZE"] for env in environments} == {"4"}
    assert [env["LOCAL_RANK"] for env in environments] == ["0", "1", "2", "3"]
    assert {env["MEGARL_ROLE"] for env in environments} == {"grid"}
    # One rendezvous address for all, on rank 0's node.
    assert len({(env["MASTER_ADDR"], env["MASTER_PORT"]) for env in environments}) == 1
    assert environments[0]["MASTER_ADDR"] == grid4.node_infos[0].ip
    assert {env["OMP_NUM_THREADS"] for env in environments} == {"1"}
    # torch's huge-page allocation on CPU workers, unless the driver's environment says otherwise.
    assert {env[HUGE_PAGES_ENV] for env in environments} == {os.environ.get(HUGE_PAGES_ENV, "1")}
    # Summed over the 4 ranks by a real gloo all_reduce; every rank gets the sum.
    assert grid4.call_all(GridWorker.all_reduce_sum, 1.5) == [6.0] * 4
    pids = grid4.call_all(GridWorker.pid)
    assert len(set(pids)) == 4
    assert grid4.call_rank(2, GridWorker.pid) == pids[2]


THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(os.environ.get(HUGE_PAGES_ENV, "1") != "1" or not THP_MODE.is_file()
                    or "[never]" in THP_MODE.read_text(),
                    reason="the driver turned huge-page allocation off, or the kernel has no transparent huge pages")
def test_cpu_workers_allocate_large_tensors_on_transparent_huge_pages(grid4):
    # torch read the variable from the start (it reads it once, at its first allocation): a 64 MiB
    # tensor lands on 2 MiB pages, all of it but the unaligned ends at most.
    grown_kib = grid4.call_rank(0, GridWorker.huge_page_kib_of_a_fresh_tensor, 64)
    assert 62 * 1024 <= grown_kib <= 66 * 1024, grown_kib


def test_extra_environment_reaches_the_workers_and_async_calls_keep_order(grid4):
    handle = grid4.call_all_async(GridWorker.environment)
    assert grid4.call_rank(1, GridWorker.pid) > 0  # submitted after it: an actor runs its calls in order
    assert [env["MEGARL_TEST_FLAG"] for env in handle.result(timeout_s=60)] == ["on"] * 4
    assert handle.done()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_call_dp_pads_uneven_batches_and_returns_rows_in_order(grid4, rows):
    grid4.init_distributed(tp=1)  # DP = 4
    batch = numbered_batch(rows)
    result = grid4.call_dp(GridWorker.affine_rows, batch, 3.0, shift=0.25)
    assert len(result) == rows
    assert result["row"].tolist() == list(range(rows))
    expected = [(-1.0 + 0.5 * i) * 3.0 + 0.25 for i in range(rows)]
    assert result["y"].tolist() == pytest.approx(expected)
    shard = math.ceil(rows / 4)  # padded to a multiple of 4, then 4 equal consecutive shards
    assert result["dp_rank"].tolist() == [i // shard for i in range(rows)]
    tensor_result = grid4.call_dp(GridWorker.row_count_tensor, batch)
    assert tensor_result.tolist() == [10 * i for i in range(rows)]


def test_padding_rows_repeat_the_first_rows_hand_worked(grid4):
    grid4.init_distributed(tp=1)
    grid4.call_dp(GridWorker.affine_rows, numbered_batch(5), 1.0, 0.0)
    # 5 rows on 4 ranks: padded to 8 with rows 0, 1, 2; shards of 2.
    assert grid4.call_all(GridWorker.rows_received) == [[0, 1], [2, 3], [4, 0], [1, 2]]


def test_dp_by_tp_layout_sends_one_shard_per_dp_group_and_collects_tp_rank_0(grid4):
    infos = grid4.init_distributed(tp=2)  # ranks (0, 1) are DP rank 0, ranks (2, 3) DP rank 1
    assert [(info.dp_rank, info.tp_rank) for info in infos] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    batch = numbered_batch(5)
    result = grid4.call_dp(GridWorker.affine_rows, batch, 2.0, -1.0)
    # TP rank 1 answers -1 for every row: none of it may appear in the collected result.
    assert result["y"].tolist() == pytest.approx([(-1.0 + 0.5 * i) * 2.0 - 1.0 for i in range(5)])
    assert result["dp_rank"].tolist() == [0, 0, 0, 1, 1]
    received = grid4.call_all(GridWorker.rows_received)
    assert received == [[0, 1, 2], [0, 1, 2], [3, 4, 0], [3, 4, 0]]
    grid4.init_distributed(tp=1)


@pytest.mark.parametrize("coords", [2, 8])
def test_dispatch_coords_of_another_world_size_are_refused_before_anything_is_sent(grid4, coords):
    grid4.init_distributed(tp=1)
    sent = grid4.calls_sent
    # 2 would fail on rank 2's missing coordinates; 8 would run and then collect from ranks 4-7.
    dispatch = [RankCoord.data_parallel_only(rank, coords) for rank in range(coords)]
    expected = rf"grid: dispatch_coords has {coords} rank coordinate\(s\) but the group has world size 4"
    with pytest.raises(DispatchError, match=expected):
        grid4.call_dp(GridWorker.affine_rows, numbered_batch(8), 1.0, 0.0, dispatch_coords=dispatch)
    assert grid4.calls_sent == sent
    # The group is untouched and still dispatches with coordinates of its size.
    own = [RankCoord.data_parallel_only(rank, 4) for rank in range(4)]
    result = grid4.call_dp(GridWorker.affine_rows, numbered_batch(8), 1.0, 0.0, dispatch_coords=own)
    assert result["row"].tolist() == list(range(8))


def test_two_roles_in_separate_pools_run_concurrently(local_cluster, cleanup):
    actor_pool = cleanup(ResourcePool("actor", nnodes=1, devices_per_node=1).wait(timeout_s=60))
    critic_pool = cleanup(ResourcePool("critic", nnodes=1, devices_per_node=1).wait(timeout_s=60))
    actor = cleanup(WorkerGroup(actor_pool, GridWorker, "actor"))
    critic = cleanup(WorkerGroup(critic_pool, GridWorker, "critic"))
    assert len(actor_pool.node_ids()) == len(critic_pool.node_ids()) == 1
    assert not set(actor.call_all(GridWorker.pid)) & set(critic.call_all(GridWorker.pid))
    actor_run = actor.call_all_async(GridWorker.sleep_interval, 1.5)
    critic_run = critic.call_all_async(GridWorker.sleep_interval, 1.5)
    [(actor_start, actor_end)], [(critic_start, critic_end)] = gather(actor_run, critic_run, timeout_s=120)
    # Overlapping intervals: each started before the other finished.
    assert actor_start < critic_end and critic_start < actor_end, (actor_start, actor_end, critic_start, critic_end)


def reference_log_probs(table: torch.Tensor, prompts: torch.Tensor, responses: torch.Tensor) -> list[list[float]]:
    """float64, explicit loops: log p(response token t | previous token) under the bigram table."""
    table = table.double()
    rows = []
    for prompt, response in zip(prompts.tolist(), responses.tolist()):
        previous, row = prompt[-1], []
        for token in response:
            logits = table[previous]
            row.append(float(logits[token] - torch.logsumexp(logits, dim=0)))
            previous = token
        rows.append(row)
    return rows


def test_colocated_actor_ref_rollout_generate_compute_log_probs_and_update(local_cluster, cleanup):
    pool = cleanup(ResourcePool("hybrid", nnodes=1, devices_per_node=2).wait(timeout_s=60))
    roles = {
        "actor": (TinyPolicy, {"seed": 7, "lr": 0.5}),
        "ref": (TinyPolicy, {"seed": 7}),
        "rollout": (TinySampler, {"response_length": 4}),
    }
    hybrid = cleanup(WorkerGroup(pool, HostWorker, "hybrid", init_kwargs={"roles": roles}))
    hybrid.init_distributed()
    actor, ref, rollout = hybrid.for_role("actor"), hybrid.for_role("ref"), hybrid.for_role("rollout")
    # Three roles, one process per rank.
    assert actor.call_all(TinyPolicy.pid) == ref.call_all(TinyPolicy.pid) == rollout.call_all(TinySampler.pid) == [i.pid for i in hybrid.node_infos]

    generator = torch.Generator().manual_seed(0)
    prompts = Batch.from_dict({"prompts": torch.randint(0, VOCAB, (5, 3), generator=generator), "row": torch.arange(5)})
    # A call names a method of the role it reaches: another role's method is refused before sending.
    with pytest.raises(TypeError, match="TinyPolicy.weights is not a method of TinySampler"):
        rollout.call_all(TinyPolicy.weights)
    with pytest.raises(TypeError, match="names the method itself"):
        rollout.call_all("sync_weights")
    rollout.call_all(TinySampler.sync_weights)
    samples = rollout.call_dp(TinySampler.generate, prompts, seed=100)  # 5 rows over DP=2: padded, then unpadded
    assert samples["responses"].shape == (5, 4)
    # Per-row seeds: the same rows generated whole on one rank give the same tokens.
    assert torch.equal(rollout.call_rank(1, TinySampler.generate, prompts, seed=100)["responses"], samples["responses"])

    initial = actor.call_rank(0, TinyPolicy.weights)
    expected = reference_log_probs(initial, prompts["prompts"], samples["responses"])
    assert samples["rollout_log_probs"].tolist() == [pytest.approx(row, abs=1e-5) for row in expected]
    batch = prompts.union(samples)
    for policy in (actor, ref):
        log_probs = policy.call_dp(TinyPolicy.compute_log_prob, batch)["log_probs"]
        assert log_probs.tolist() == [pytest.approx(row, abs=1e-5) for row in expected]

    # One update of the actor on 4 rows (2 per DP rank, no padding), gradients averaged by gloo.
    train = batch[torch.arange(4)]
    train["advantages"] = torch.tensor([[1.0], [-1.0], [0.5], [2.0]]).expand(4, 4).clone()
    losses = actor.call_dp(TinyPolicy.update, train)
    assert len(losses) == 2
    table = initial.double().requires_grad_(True)
    shard_losses = []
    for rows in ([0, 1], [2, 3]):  # each DP rank's mean loss over its (2 x 4) tokens
        lp = torch.stack([torch.stack([torch.log_softmax(table[p], 0)[t] for p, t in zip(prev, resp)])
                          for prev, resp in ((torch.cat([train["prompts"][r, -1:], train["responses"][r, :-1]]),
                                              train["responses"][r]) for r in rows)])
        shard_losses.append(-(train["advantages"][rows].double() * lp).mean())
    (0.5 * (shard_losses[0] + shard_losses[1])).backward()
    shard_losses = [loss.detach() for loss in shard_losses]
    expected_table = (initial.double() - 0.5 * table.grad).float()
    updated = actor.call_all(TinyPolicy.weights)
    assert torch.allclose(updated[0], expected_table, atol=1e-5) and torch.equal(updated[0], updated[1])
    assert losses == pytest.approx([loss.item() for loss in shard_losses], abs=1e-5)

    # Phase change: rollout only, then training again; offloaded weights come back unchanged.
    rollout.call_all(TinySampler.sync_weights)  # local copy of the new actor weights into the rollout role
    assert hybrid.call_all(HostWorker.set_active, ["rollout"]) == [{"actor": "offloaded", "ref": "offloaded"}] * 2
    assert actor.call_all(TinyPolicy.is_offloaded) == [True, True]
    fresh = rollout.call_dp(TinySampler.generate, prompts, seed=100)
    assert hybrid.call_all(HostWorker.set_active, ["actor", "ref"]) == [{"actor": "onloaded", "ref": "onloaded"}] * 2
    assert torch.equal(actor.call_rank(1, TinyPolicy.weights), updated[1])
    new_expected = reference_log_probs(updated[0], prompts["prompts"], fresh["responses"])
    assert fresh["rollout_log_probs"].tolist() == [pytest.approx(r, abs=1e-5) for r in new_expected]
    fresh_batch = prompts.union(fresh)
    new_actor = actor.call_dp(TinyPolicy.compute_log_prob, fresh_batch)["log_probs"]
    new_ref = ref.call_dp(TinyPolicy.compute_log_prob, fresh_batch)["log_probs"]
    assert torch.allclose(new_actor, fresh["rollout_log_probs"], atol=1e-5)
    assert not torch.allclose(new_ref, new_actor, atol=1e-3)  # the reference policy did not move
    ref_expected = reference_log_probs(initial, prompts["prompts"], fresh["responses"])
    assert new_ref.tolist() == [pytest.approx(row, abs=1e-5) for row in ref_expected]


def test_megatron_layout_through_the_engine_hook_drives_dispatch(local_cluster, cleanup):
    pool = cleanup(ResourcePool("megatron", nnodes=1, devices_per_node=2).wait(timeout_s=60))
    group = cleanup(WorkerGroup(pool, GridWorker, "actor"))
    infos = group.init_distributed(layout={"tp": 2})  # megarl.megatron.parallel.init_distributed
    assert [(i.dp_rank, i.dp_size, i.tp_rank, i.tp_size) for i in infos] == [(0, 1, 0, 2), (0, 1, 1, 2)]
    result = group.call_dp(GridWorker.affine_rows, numbered_batch(3), 1.0, 1.0)
    assert result["y"].tolist() == [0.0, 0.5, 1.0]  # from TP rank 0 (rank 1 answers -1)
    assert group.call_all(GridWorker.rows_received) == [[0, 1, 2], [0, 1, 2]]
