"""Sampling filters and parameter validation, against hand-worked examples."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.errors import ConfigError
from megarl.rollout import EngineOptions, SamplingParams
from megarl.rollout.sampling import filter_logits, sample_next_tokens

pytestmark = pytest.mark.unit

NEG_INF = float("-inf")


def test_top_k_keeps_the_k_largest_after_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    out = filter_logits(logits, SamplingParams(temperature=2.0, top_k=2))
    assert out.tolist() == [[1.0, 0.5, NEG_INF, NEG_INF]]


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05 (sorted order scrambled on purpose)
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    logits = probs.log()
    # mass before each token (descending): 0.5 -> 0, 0.3 -> 0.5, 0.15 -> 0.8, 0.05 -> 0.95
    keep_07 = filter_logits(logits, SamplingParams(top_p=0.7)).isfinite().tolist()
    assert keep_07 == [[False, True, False, True]]
    keep_08 = filter_logits(logits, SamplingParams(top_p=0.8)).isfinite().tolist()
    assert keep_08 == [[False, True, False, True]]  # 0.8 already reached before the third token
    keep_081 = filter_logits(logits, SamplingParams(top_p=0.81)).isfinite().tolist()
    assert keep_081 == [[True, True, False, True]]
    keep_tiny = filter_logits(logits, SamplingParams(top_p=1e-9)).isfinite().tolist()
    assert keep_tiny == [[False, True, False, False]]


def test_processed_log_prob_is_renormalised_over_the_kept_tokens() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.5, -2.0]])
    params = SamplingParams(top_k=2, temperature=0.5)
    uniforms = torch.tensor([0.3], dtype=torch.float64)
    token, log_prob = sample_next_tokens(logits, params, "processed", uniforms)
    assert token.item() in (0, 1)
    kept = [3.0 / 0.5, 1.0 / 0.5]
    expected = kept[token.item()] - math.log(sum(math.exp(x) for x in kept))
    assert log_prob.item() == pytest.approx(expected, abs=1e-6)
    _, raw = sample_next_tokens(logits, params, "raw", uniforms)
    expected_raw = logits[0, token.item()].item() - math.log(sum(math.exp(x) for x in logits[0].tolist()))
    assert raw.item() == pytest.approx(expected_raw, abs=1e-6)


def test_greedy_log_prob_ignores_temperature() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    token, log_prob = sample_next_tokens(logits, SamplingParams.make_greedy(4, temperature=0.3), "processed")
    assert token.item() == 1
    assert log_prob.item() == pytest.approx(2.0 - math.log(1 + math.exp(2) + math.exp(1)), abs=1e-6)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(n=0), "n must be"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=0.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        SamplingParams(**kwargs)


def test_greedy_allows_zero_temperature() -> None:
    params = SamplingParams(temperature=0.0, greedy=True, max_new_tokens=3)
    assert params.greedy and params.max_new_tokens == 3


def test_bad_engine_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="logprobs_mode"):
        EngineOptions(pad_token_id=0, eos_token_ids=(1,), logprobs_mode="tempered")
    with pytest.raises(ConfigError, match="dtype"):
        EngineOptions(pad_token_id=0, eos_token_ids=(1,), dtype="fp8")
