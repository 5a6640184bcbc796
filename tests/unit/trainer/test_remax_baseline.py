"""ReMax's baseline response (`RLTrainer.remax_baseline`) is decoded like the samples it is the
baseline of, greedily: one per prompt, the same length, and `rollout.ignore_eos` as theirs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megarl.protocol import Batch
from megarl.rollout.base import SamplingParams
from megarl.trainer.loop import RLTrainer

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_greedy_baseline_decodes_with_the_samples_settings(ignore_eos: bool) -> None:
    # Two prompts x two samples; the trainer's generate and score are recorded at their boundary.
    uid = np.array(["a", "a", "b", "b"], dtype=object)
    batch = Batch.from_dict({"prompts": torch.tensor([[5, 6]] * 4), "attention_mask": torch.ones(4, 5, dtype=torch.int64),
                             "responses": torch.ones(4, 3, dtype=torch.int64)}, {"uid": uid})
    calls: list[SamplingParams] = []

    def generate(prompts: Batch, params: SamplingParams) -> Batch:
        calls.append(params)
        return prompts

    def score(rows: Batch) -> tuple[Batch, dict]:
        scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])  # a -> 1.0, b -> 0.5
        return Batch.from_dict({"token_level_scores": scores}, {"uid": rows["uid"]}), {}

    train = SamplingParams(n=2, max_new_tokens=3, temperature=0.7, ignore_eos=ignore_eos)
    trainer = SimpleNamespace(generate=generate, score=score, rollout_sleep=lambda after: None, response_length=3,
                              spec=SimpleNamespace(train_sampling=train))
    baseline = RLTrainer.remax_baseline(trainer, batch)
    assert baseline.tolist() == [1.0, 1.0, 0.5, 0.5]
    (params,) = calls
    assert (params.greedy, params.n, params.max_new_tokens, params.ignore_eos) == (True, 1, 3, ignore_eos)
