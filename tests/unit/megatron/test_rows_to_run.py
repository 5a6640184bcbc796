"""The rows an update runs when it skips rows of zero advantage (`engine.rows_to_run`), by hand."""

from __future__ import annotations

import pytest
import torch

from megarl.errors import DataError
from megarl.megatron.engine import rows_to_run

pytestmark = pytest.mark.unit


def _mini_batch(advantages: list[list[float]], mask: list[list[int]], lengths: list[int]) -> dict[str, torch.Tensor]:
    rows = len(advantages)
    attention = (torch.arange(8) < torch.tensor(lengths).unsqueeze(-1)).long()
    return {"advantages": torch.tensor(advantages, dtype=torch.float32), "response_mask": torch.tensor(mask),
            "attention_mask": attention, "update_row": torch.arange(rows)}


def test_rows_of_zero_advantage_are_left_out() -> None:
    data = _mini_batch([[0, 0], [1, 0], [0, 0], [0, -2]], [[1, 1], [1, 1], [1, 0], [1, 1]], [5, 6, 4, 7])
    assert rows_to_run(data).tolist() == [False, True, False, True]


def test_every_row_runs_when_each_has_an_advantage() -> None:
    data = _mini_batch([[0, 3], [1, 0]], [[1, 1], [1, 1]], [5, 6])
    assert rows_to_run(data).tolist() == [True, True]


def test_one_row_runs_when_none_has_an_advantage() -> None:
    # Every rank must run the step's schedule (its gradient reduction): the row of fewest tokens stays;
    # row 2's advantage lies on a padding token.
    data = _mini_batch([[0, 0], [0, 0], [0, 5]], [[1, 1], [1, 1], [1, 0]], [6, 3, 5])
    assert rows_to_run(data).tolist() == [False, True, False]


def test_a_batch_without_advantages_is_refused_by_name() -> None:
    data = _mini_batch([[0, 1]], [[1, 1]], [4])
    del data["advantages"]
    with pytest.raises(DataError, match="advantages"):
        rows_to_run(data)
