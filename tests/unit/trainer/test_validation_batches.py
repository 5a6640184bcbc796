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
