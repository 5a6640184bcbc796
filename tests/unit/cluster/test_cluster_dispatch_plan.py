"""Data-parallel dispatch planning, splitting and merging (pure functions, no Ray)."""

from __future__ import annotations

import pytest
import torch

from megarl.cluster.dispatch import (
    DispatchError,
    ShardPadding,
    merge_data_parallel_results,
    plan_dispatch,
    split_for_data_parallel,
)
from megarl.layout import RankCoord
from megarl.protocol import Batch


def grid(dp: int, tp: int, pp: int = 1) -> list[RankCoord]:
    """Megatron's default rank order: TP fastest, then DP, then PP."""
    infos = []
    for rank in range(dp * tp * pp):
        tp_rank, rest = rank % tp, rank // tp
        dp_rank, pp_rank = rest % dp, rest // dp
        infos.append(RankCoord(rank=rank, dp_rank=dp_rank, dp_size=dp, tp_rank=tp_rank, tp_size=tp,
                               pp_rank=pp_rank, pp_size=pp))
    return infos


def test_pure_data_parallel_plan_collects_every_rank():
    plan = plan_dispatch([RankCoord.data_parallel_only(rank, 3) for rank in range(3)])
    assert plan.dp_size == 3
    assert plan.shard_of_rank == (0, 1, 2)
    assert plan.collect_ranks == (0, 1, 2)


def test_tp2_pp2_dp2_collects_from_last_stage_tp_rank_0():
    # 8 ranks: ranks 0-3 are stage 0, 4-7 stage 1; within a stage (dp0: tp0, tp1), (dp1: tp0, tp1).
    plan = plan_dispatch(grid(dp=2, tp=2, pp=2))
    assert plan.shard_of_rank == (0, 0, 1, 1, 0, 0, 1, 1)
    assert plan.collect_ranks == (4, 6)


def test_context_parallel_rank_0_only_is_collected():
    infos = [RankCoord(rank=r, dp_rank=0, dp_size=1, cp_rank=r, cp_size=2) for r in range(2)]
    assert plan_dispatch(infos).collect_ranks == (0,)


@pytest.mark.parametrize(
    "infos, message",
    [
        ([], "empty"),
        ([RankCoord(rank=1, dp_rank=0, dp_size=1)], "position 0 belongs to rank 1"),
        ([RankCoord(rank=0, dp_rank=0, dp_size=2), RankCoord(rank=1, dp_rank=0, dp_size=1)], "disagree"),
        ([RankCoord(rank=0, dp_rank=0, dp_size=2), RankCoord(rank=1, dp_rank=2, dp_size=2)], "outside"),
        ([RankCoord(rank=0, dp_rank=0, dp_size=1), RankCoord(rank=1, dp_rank=0, dp_size=1)],
         r"data-parallel rank 0 .* found ranks \[0, 1\]"),
        ([RankCoord(rank=0, dp_rank=0, dp_size=2, tp_rank=1, tp_size=2),
          RankCoord(rank=1, dp_rank=1, dp_size=2)], r"data-parallel rank 0 .* found ranks \[\]"),
    ],
)
def test_inconsistent_layouts_are_refused_with_the_reason(infos, message):
    with pytest.raises(DispatchError, match=message):
        plan_dispatch(infos)


def numbered(rows: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(rows) * 2}, non_tensors={"uid": [f"u{i}" for i in range(rows)]})


def test_split_pads_with_leading_rows_hand_worked():
    shards, padding = split_for_data_parallel(numbered(5), 3)
    assert padding == ShardPadding(rows=1, shard_rows=2, shards=3)
    assert [shard["x"].tolist() for shard in shards] == [[0, 2], [4, 6], [8, 0]]
    assert [list(shard["uid"]) for shard in shards] == [["u0", "u1"], ["u2", "u3"], ["u4", "u0"]]


def test_fewer_rows_than_ranks_still_gives_every_rank_a_row():
    shards, padding = split_for_data_parallel(numbered(2), 4)
    assert padding.rows == 2 and [shard["x"].tolist() for shard in shards] == [[0], [2], [0], [2]]


@pytest.mark.parametrize("rows, dp", [(1, 1), (1, 4), (7, 2), (8, 4), (9, 4), (10, 3)])
def test_split_then_merge_round_trips_rows_in_order(rows, dp):
    batch = numbered(rows)
    shards, padding = split_for_data_parallel(batch, dp)
    assert len({len(shard) for shard in shards}) == 1
    merged = merge_data_parallel_results(shards, padding)
    assert merged["x"].tolist() == [2 * i for i in range(rows)]
    assert list(merged["uid"]) == [f"u{i}" for i in range(rows)]
    tensors = merge_data_parallel_results([shard["x"] for shard in shards], padding)
    assert tensors.tolist() == [2 * i for i in range(rows)]


def test_merge_of_non_row_results():
    _, padding = split_for_data_parallel(numbered(3), 2)
    assert merge_data_parallel_results([None, None], padding) is None
    metrics = [{"loss": 1.0}, {"loss": 2.0}]
    assert merge_data_parallel_results(metrics, padding) == metrics


def test_empty_batch_is_refused():
    with pytest.raises(DispatchError, match="empty batch"):
        split_for_data_parallel(numbered(0), 2)


def samples(shard: Batch, n: int) -> Batch:
    """What rollout's generate returns for a shard: n rows per prompt, each prompt's together."""
    out = shard.repeat(n, interleave=True)
    out["sample"] = torch.arange(len(out)) % n
    return out


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("rows, dp", [(3, 2), (5, 3), (7, 4), (1, 4), (2, 4), (3, 8), (4, 2)])
def test_merge_drops_every_output_of_the_padding_rows(rows, dp, n):
    # 3 prompts over DP=2 with n=4 once gave 15 rows: prompt 0's padding copy kept 3 of its 4 samples.
    shards, padding = split_for_data_parallel(numbered(rows), dp)
    merged = merge_data_parallel_results([samples(shard, n) for shard in shards], padding)
    assert merged["x"].tolist() == [2 * i for i in range(rows) for _ in range(n)]
    assert list(merged["uid"]) == [f"u{i}" for i in range(rows) for _ in range(n)]
    assert merged["sample"].tolist() == list(range(n)) * rows
    tensors = merge_data_parallel_results([samples(shard, n)["x"] for shard in shards], padding)
    assert tensors.tolist() == [2 * i for i in range(rows) for _ in range(n)]


def test_rows_per_input_row_are_counted_per_shard():
    shards, padding = split_for_data_parallel(numbered(3), 2)  # [u0, u1], [u2, u0 (padding)]
    merged = merge_data_parallel_results([samples(shards[0], 2), samples(shards[1], 3)], padding)
    assert list(merged["uid"]) == ["u0", "u0", "u1", "u1", "u2", "u2", "u2"]


def test_a_result_that_is_not_whole_rows_per_input_row_is_refused_with_the_method():
    shards, padding = split_for_data_parallel(numbered(3), 2)  # 2 rows a shard
    results = [samples(shards[0], 2), samples(shards[1], 2)[:3]]
    with pytest.raises(DispatchError, match=r"RolloutRole.generate returned 3 rows for data shard 1 of 2 rows"):
        merge_data_parallel_results(results, padding, method="RolloutRole.generate")
    with pytest.raises(DispatchError, match=r"a data-parallel call returned 3 rows"):
        merge_data_parallel_results([r["x"] for r in results], padding)


def test_without_padding_every_result_row_is_kept():
    shards, padding = split_for_data_parallel(numbered(4), 2)
    merged = merge_data_parallel_results([shards[0][:1], shards[1]], padding)  # nothing to drop
    assert merged["x"].tolist() == [0, 4, 6]


def test_merge_refuses_a_wrong_number_of_shard_results():
    shards, padding = split_for_data_parallel(numbered(3), 2)
    with pytest.raises(DispatchError, match="got 1 shard results for 2 data shards"):
        merge_data_parallel_results(shards[:1], padding)


def test_a_worker_uses_its_local_rank_among_the_devices_it_sees() -> None:
    """Ray shows a worker given one GPU that GPU alone (cuda:0), whatever its local rank on the
    node; vLLM's external launcher and Megatron both take this index (LOCAL_RANK 3 was cuda:3)."""
    from megarl.cluster.worker import visible_device_index

    assert [visible_device_index(r, 1) for r in range(4)] == [0, 0, 0, 0]
    assert [visible_device_index(str(r), 8) for r in (0, 3, 7)] == [0, 3, 7]
    assert visible_device_index(5, 4) == 1 and visible_device_index(2, 0) == 0
