"""Padding removal and micro-batch planning, against explicit loops."""

from __future__ import annotations

import pytest
import torch

from megarl.errors import ConfigError, DataError
from megarl.megatron.packing import compact_rows, gather_response, pack_rows, plan_micro_batches, unpack


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 0], [1, 2, 3, 4, 9, 0, 0], [0, 3, 4, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]])
    return ids, mask


def test_compact_rows_moves_valid_tokens_to_the_front() -> None:
    ids, mask = _batch()
    rows = compact_rows(ids, mask, response_len=3)  # prompt width 4
    assert rows.tokens.tolist() == [[5, 6, 7, 8, 0, 0], [1, 2, 3, 4, 9, 0], [3, 4, 5, 6, 7, 8]]
    assert rows.prompt_lens.tolist() == [2, 4, 3] and rows.total_lens.tolist() == [4, 5, 6]


def test_gather_response_picks_the_predicting_position() -> None:
    ids, mask = _batch()
    rows = compact_rows(ids, mask, response_len=3)
    per_position = torch.arange(18, dtype=torch.float).reshape(3, 6)  # value = 6*row + position
    got = gather_response(per_position, rows)
    want = torch.zeros(3, 3)
    for b in range(3):  # response token t of row b sits at L_b + t; it is predicted from L_b + t - 1
        for t in range(3):
            if mask[b, 4 + t]:
                want[b, t] = 6 * b + int(rows.prompt_lens[b]) + t - 1
    assert torch.equal(got, want)


def test_row_without_prompt_is_refused() -> None:
    with pytest.raises(DataError, match="row 0"):
        compact_rows(torch.ones(1, 4, dtype=torch.long), torch.tensor([[0, 0, 1, 1]]), response_len=2)


def test_fixed_micro_batches_are_consecutive_chunks() -> None:
    plans = plan_micro_batches(torch.tensor([3, 1, 4, 1, 5]), micro_batch_size=2)
    assert [p.tolist() for p in plans] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("budget", [5, 8, 12, 40])
def test_dynamic_micro_batches_respect_the_token_budget(budget: int) -> None:
    lengths = torch.tensor([5, 1, 3, 2, 5, 4, 1, 2])
    plans = plan_micro_batches(lengths, max_tokens=budget)
    seen = sorted(i for p in plans for i in p.tolist())
    assert seen == list(range(8))
    for p in plans:
        assert len(p) * int(lengths[p].max()) <= budget
    if budget >= 40:
        assert len(plans) == 1


def test_dynamic_budget_below_longest_sequence_is_an_error() -> None:
    with pytest.raises(ConfigError, match="at least 5"):
        plan_micro_batches(torch.tensor([5, 2]), max_tokens=4)


def test_pack_rows_mask_and_unpack_against_loops() -> None:
    ids, mask = _batch()
    rows = compact_rows(ids, mask, response_len=3)
    packed = pack_rows(rows)
    assert packed.tokens.tolist() == [[5, 6, 7, 8, 1, 2, 3, 4, 9, 3, 4, 5, 6, 7, 8]]
    assert packed.cu_seqlens.tolist() == [0, 4, 9, 15]
    owner = [0] * 4 + [1] * 5 + [2] * 6
    for i in range(15):
        for j in range(15):
            visible = owner[i] == owner[j] and j <= i
            assert bool(packed.attention_mask[0, 0, i, j]) == (not visible)
    per_position = torch.arange(15, dtype=torch.float).unsqueeze(0)
    back = unpack(per_position, packed, width=6)
    assert back.tolist() == [[0, 1, 2, 3, 0, 0], [4, 5, 6, 7, 8, 0], [9, 10, 11, 12, 13, 14]]


def test_packed_token_budget_counts_real_tokens() -> None:
    lengths = torch.tensor([5, 1, 3, 2])
    plans = plan_micro_batches(lengths, max_tokens=6, packed=True)
    assert all(int(lengths[p].sum()) <= 6 for p in plans) and len(plans) == 2


def test_packed_budget_per_cp_rank_gets_the_balanced_split() -> None:
    # 40 tokens, 20 per CP rank at cp 2: two micro-batches of 20 (10 per rank) fit a budget of 10.
    # Greedy by length closes at 10+6 and 6+4+4+4 (each padded to 16 and 20): three micro-batches;
    # the balanced search must start from ceil(20 per rank / 10) = 2, not ceil(40 / 10) = 4.
    lengths = torch.tensor([10, 6, 6, 4, 4, 4, 4, 2])
    plans = plan_micro_batches(lengths, max_tokens=10, packed=True, cp=2)
    assert len(plans) == 2, [p.tolist() for p in plans]
    assert sorted(i for p in plans for i in p.tolist()) == list(range(8))
    assert all(-(-int(lengths[p].sum()) // 4) * 4 // 2 <= 10 for p in plans)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("count", [1, 2, 3, 5, 8])
def test_min_micro_batches_splits_within_the_budget(packed: bool, count: int) -> None:
    lengths = torch.tensor([5, 1, 3, 2, 5, 4, 1, 2])
    plans = plan_micro_batches(lengths, max_tokens=24, packed=packed, min_micro_batches=count)
    alone = plan_micro_batches(lengths, max_tokens=24, packed=packed)
    assert len(plans) == max(count, len(alone)), [p.tolist() for p in plans]
    assert sorted(i for p in plans for i in p.tolist()) == list(range(8))
    for p in plans:
        assert len(p) > 0
        assert (int(lengths[p].sum()) if packed else len(p) * int(lengths[p].max())) <= 24


def test_min_micro_batches_keeps_padded_rows_of_similar_length_together() -> None:
    # One micro-batch of everything (8 x 5 = 40 <= 40); three: the longest rows stay together.
    lengths = torch.tensor([5, 1, 3, 2, 5, 4, 1, 2])
    plans = plan_micro_batches(lengths, max_tokens=40, min_micro_batches=3)
    assert sorted(sorted(int(lengths[i]) for i in p) for p in plans) == [[1, 1, 2, 2], [3, 4], [5, 5]]


def test_more_micro_batches_than_rows_is_an_error() -> None:
    with pytest.raises(DataError, match="3 rows into 4 non-empty micro-batches"):
        plan_micro_batches(torch.tensor([3, 1, 2]), max_tokens=10, min_micro_batches=4)
