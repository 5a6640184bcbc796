"""The run report plots the reward model's score (mean with its min–max band) and summarises it."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from megarl.tracking.report import write_report

pytestmark = pytest.mark.unit


def test_reward_model_score_is_plotted_and_summarised(tmp_path: Path) -> None:
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 11):
            metrics = {"critic/score/mean": 0.1 * step, "reward_model/score/mean": -1.0 + 0.2 * step,
                       "reward_model/score/min": -2.0 + 0.2 * step, "reward_model/score/max": 0.2 * step}
            f.write(json.dumps({"step": step, "time": 100.0 + step, "metrics": metrics}) + "\n")
    paths = write_report(tmp_path, k=2)
    image = mpimg.imread(paths["reward_model"])
    assert image.ndim == 3 and image.std() > 0.01
    # first 2 steps: -0.8, -0.6 -> -0.7; last 2: 0.8, 1.0 -> 0.9
    assert ("- reward-model score (reward_model/score/mean): first 2 steps -0.7000, last 2 steps 0.9000 (+1.6000)"
            in paths["summary"].read_text())


def test_no_reward_model_no_plot(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 1.0, "metrics": {"critic/score/mean": 1.0}}) + "\n")
    paths = write_report(tmp_path)
    assert "reward_model" not in paths and "reward-model score" not in paths["summary"].read_text()
