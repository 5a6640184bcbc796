"""A user reward function may return numpy and torch scalars, as verl's reward managers accept them:
numpy scalars (np.bool_ too), 0-d arrays and 0-d tensors count as the number they hold, as score and
as extra keys; an array or tensor of several elements is refused, naming its type and shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megarl.rewards.pool import ScoringPool
from megarl.rewards.worker import ScoringTarget, normalize_result

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.mark.parametrize(("value", "score"), [
    (np.bool_(True), 1.0),
    (np.bool_(False), 0.0),
    (np.float32(0.5), 0.5),
    (np.int64(3), 3.0),
    (np.array(0.25), 0.25),
    (np.array(True), 1.0),
    (torch.tensor(0.75), 0.75),
    (torch.tensor(2, dtype=torch.int32), 2.0),
    (torch.tensor(True), 1.0),
    ({"score": np.array(1.0)}, 1.0),
    ({"score": torch.tensor(0.5)}, 0.5),
])
def test_numpy_and_torch_scalars_are_scores(value: object, score: float) -> None:
    assert normalize_result(value) == ("ok", {"score": score})


def test_numpy_and_torch_scalars_are_kept_as_extra_keys() -> None:
    value = {"score": 1.0, "acc": np.bool_(True), "format": np.float32(0.5), "len": torch.tensor(7),
             "zero_d": np.array(2.0), "several": np.ones(3), "note": "text"}
    assert normalize_result(value) == (
        "ok", {"score": 1.0, "acc": 1.0, "format": 0.5, "len": 7.0, "zero_d": 2.0})


@pytest.mark.parametrize(("value", "reason"), [
    (np.array([1.0, 2.0]), "returned ndarray of shape (2,), not a single number"),
    (np.array([1.0]), "returned ndarray of shape (1,), not a single number"),
    (torch.ones(2, 3), "returned Tensor of shape (2, 3), not a single number"),
    ({"score": np.zeros(4)}, "returned score as ndarray of shape (4,), not a single number"),
    (np.float64("nan"), "not a finite number"),
    (torch.tensor(float("inf")), "not a finite number"),
    ({"score": np.array(float("nan"))}, "not a finite number"),
])
def test_arrays_of_several_elements_and_non_finite_values_are_refused(value: object, reason: str) -> None:
    status, message = normalize_result(value)
    assert status == "bad_return" and reason in message


USER_FILE = """
import numpy as np
import torch


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str == ground_truth
    if data_source == "numpy_bool":
        return np.bool_(correct)
    if data_source == "zero_d_tensor":
        return torch.tensor(float(correct))
    if data_source == "dict":
        return {"score": np.float32(correct), "acc": np.bool_(correct), "len": torch.tensor(len(solution_str))}
    return np.arange(3.0)
"""


def test_a_user_function_returning_numpy_and_torch_values_scores_in_the_worker(tmp_path: Path) -> None:
    path = tmp_path / "reward_numpy.py"
    path.write_text(USER_FILE)
    with ScoringPool(ScoringTarget(str(path), "compute_score"), 1, 60.0) as pool:
        outcomes = pool.map([("numpy_bool", "7", "7", None), ("zero_d_tensor", "6", "7", None),
                             ("dict", "7", "7", None), ("vector", "7", "7", None)])
    assert [o.status for o in outcomes] == ["ok", "ok", "ok", "bad_return"]
    assert [o.result for o in outcomes[:3]] == [{"score": 1.0}, {"score": 0.0},
                                                {"score": 1.0, "acc": 1.0, "len": 1.0}]
    assert "returned ndarray of shape (3,), not a single number" in outcomes[3].reason
