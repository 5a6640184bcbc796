"""Validation in batches of `data.val_batch_size`: each batch is generated with the index of its first
prompt in the set, so that sampled validation (`rollout.val_kwargs.do_sample`) gives every row a random
stream of its own whatever the batch size (`SamplingParams.row_offset`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.protocol import Batch
from megarl.trainer.validation import validate

pytestmark = pytest.mark.unit


def test_each_batch_is_generated_from_its_first_prompts_index() -> None:
    def prompts(first: int, size: int) -> Batch:
        return Batch.from_dict({"input_ids": torch.zeros(size, 2, dtype=torch.long)},
                               non_tensors={"uid": [f"val-{first + i}" for i in range(size)],
                                            "data_source": ["arithmetic"] * size})

    seen: list[int] = []

    def generate(batch: Batch, first: int) -> Batch:
        seen.append(first)
        assert batch["uid"][0] == f"val-{first}"
        return batch

    def score(batch: Batch) -> Batch:
        batch["token_level_scores"] = torch.ones(len(batch), 1)
        return batch

    metrics, _ = validate([prompts(0, 3), prompts(3, 3), prompts(6, 2)], generate, score, n=1)
    assert seen == [0, 3, 6]
    assert metrics["val/reward_mean"] == 1.0 and np.isclose(metrics["val-core/arithmetic/reward/mean@1"], 1.0)


def test_metrics_follow_verls_sections_with_hand_worked_values() -> None:
    """Two samples per prompt. Source a: prompt p1 scores 1 and 0 (acc 1, 0), p2 scores 0.5 and 0.5
    (acc 0, 0); source b: p3 scores 2 and 0 (acc 1, 1). Accuracy is the core variable: its mean@2
    and best@2/mean are val-core, everything else val-aux; a text reward_info value is left out."""
    rows = [("a", "p1", 1.0, 1), ("a", "p1", 0.0, 0), ("a", "p2", 0.5, 0), ("a", "p2", 0.5, 0),
            ("b", "p3", 2.0, 1), ("b", "p3", 0.0, 1)]
    batch = Batch.from_dict({"input_ids": torch.zeros(len(rows), 2, dtype=torch.long)},
                            non_tensors={"uid": [r[1] for r in rows], "data_source": [r[0] for r in rows]})

    def score(gen: Batch) -> Batch:
        gen["token_level_scores"] = torch.tensor([[r[2]] for r in rows])
        gen["reward_info/acc"] = np.array([r[3] for r in rows])
        gen["reward_info/pred"] = np.array(["7", "x", "3", "3", "9", "9"], dtype=object)
        return gen

    metrics, _ = validate([batch], lambda b, first: b, score, n=2)
    want = {
        "val/reward_mean": 4 / 6,
        "val-core/a/acc/mean@2": 0.25, "val-core/a/acc/best@2/mean": 0.5,
        "val-aux/a/acc/std@2": 0.25, "val-aux/a/acc/worst@2/mean": 0.0,
        "val-aux/a/reward/mean@2": 0.5, "val-aux/a/reward/std@2": 0.25,
        "val-aux/a/reward/best@2/mean": 0.75, "val-aux/a/reward/worst@2/mean": 0.25,
        "val-core/b/acc/mean@2": 1.0, "val-core/b/acc/best@2/mean": 1.0,
        "val-aux/b/acc/std@2": 0.0, "val-aux/b/acc/worst@2/mean": 1.0,
        "val-aux/b/reward/mean@2": 1.0, "val-aux/b/reward/std@2": 1.0,
        "val-aux/b/reward/best@2/mean": 2.0, "val-aux/b/reward/worst@2/mean": 0.0,
    }
    assert set(metrics) == set(want)
    for key, value in want.items():
        assert metrics[key] == pytest.approx(value, abs=1e-12), key


def test_without_accuracy_the_reward_is_the_core_variable() -> None:
    batch = Batch.from_dict({"input_ids": torch.zeros(2, 2, dtype=torch.long)},
                            non_tensors={"uid": ["p1", "p2"], "data_source": ["s", "s"]})

    def score(gen: Batch) -> Batch:
        gen["token_level_scores"] = torch.tensor([[1.0], [0.0]])
        return gen

    metrics, _ = validate([batch], lambda b, first: b, score, n=1)
    assert metrics == {"val/reward_mean": 0.5, "val-core/s/reward/mean@1": 0.5}
