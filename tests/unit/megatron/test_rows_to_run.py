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


def test_rows_of_zero_advantage_are_left_out_and_counted() -> None:
    data = _mini_batch([[0, 0], [1, 0], [0, 0], [0, -2]], [[1, 1], [1, 1], [1, 0], [1, 1]], [5, 6, 4, 7])
    run, skipped = rows_to_run(data)
    assert run["update_row"].tolist() == [1, 3] and skipped == 0.5
    assert all(len(v) == 2 for v in run.values())
    torch.testing.assert_close(run["advantages"], torch.tensor([[1.0, 0.0], [0.0, -2.0]]), atol=0, rtol=0)


def test_every_row_runs_when_each_has_an_advantage() -> None:
    data = _mini_batch([[0, 3], [1, 0]], [[1, 1], [1, 1]], [5, 6])
    run, skipped = rows_to_run(data)
    assert run is data and skipped == 0.0


def test_one_row_runs_when_none_has_an_advantage() -> None:
    # Every rank must run the step's schedule (its gradient reduction): the row of fewest tokens stays.
    data = _mini_batch([[0, 0], [0, 0], [0, 5]], [[1, 1], [1, 1], [1, 0]], [6, 3, 5])
    run, skipped = rows_to_run(data)
    assert run["update_row"].tolist() == [1] and skipped == pytest.approx(2 / 3)


def test_a_batch_without_advantages_is_refused_by_name() -> None:
    data = _mini_batch([[0, 1]], [[1, 1]], [4])
    del data["advantages"]
    with pytest.raises(DataError, match="advantages"):
        rows_to_run(data)
