"""Data, timing and throughput metrics against numbers worked out by hand from their definitions."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.tracking.metrics import (
    compute_data_metrics,
    compute_throughput,
    compute_timing_metrics,
    count_tokens,
    reduce_metrics,
)

pytestmark = pytest.mark.unit

X = 100.0  # a value in padding: must never reach a statistic


def _batch() -> dict[str, torch.Tensor]:
    """3 responses, R=4, P=3. Response lengths 3, 4 (cut at the limit), 1; prompt lengths 2, 3, 1."""
    response_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    return {
        "response_mask": response_mask,
        "attention_mask": torch.cat([prompt_mask, response_mask.long()], dim=1),
        # Sequence scores 1.0, 0.0, 0.5 (the 9.0 sits in padding).
        "token_level_scores": torch.tensor([[0, 0, 1.0, 9.0], [0, 0, 0, 0.0], [0.5, 0, 0, 0]]),
        # Sequence rewards 0.7, -0.2, 0.5.
        "token_level_rewards": torch.tensor([[-0.1, -0.1, 0.9, 0], [0, 0, 0, -0.2], [0.5, 0, 0, 0]]),
        # Valid tokens: 1 2 3 | -1 -1 -1 -1 | 4.
        "advantages": torch.tensor([[1.0, 2, 3, X], [-1, -1, -1, -1], [4, X, X, X]]),
        # Valid tokens: 1 1 1 | 0 0 0 0 | 2.
        "returns": torch.tensor([[1.0, 1, 1, X], [0, 0, 0, 0], [2, X, X, X]]),
        # Valid tokens: 1 1 1 | 0 0 0 0 | 1  ->  returns - values = 0 x7, then 1.
        "values": torch.tensor([[1.0, 1, 1, X], [0, 0, 0, 0], [1, X, X, X]]),
    }


def test_data_metrics_match_hand_computed_values() -> None:
    m = compute_data_metrics(_batch())
    expected = {
        "critic/score/mean": 1.5 / 3, "critic/score/max": 1.0, "critic/score/min": 0.0,
        "critic/rewards/mean": 1.0 / 3, "critic/rewards/max": 0.7, "critic/rewards/min": -0.2,
        "critic/advantages/mean": 6 / 8, "critic/advantages/max": 4.0, "critic/advantages/min": -1.0,
        "critic/returns/mean": 5 / 8, "critic/returns/max": 2.0, "critic/returns/min": 0.0,
        "critic/values/mean": 4 / 8, "critic/values/max": 1.0, "critic/values/min": 0.0,
        "response_length/mean": 8 / 3, "response_length/max": 4.0, "response_length/min": 1.0,
        "response_length/clip_ratio": 1 / 3,
        "prompt_length/mean": 2.0, "prompt_length/max": 3.0, "prompt_length/min": 1.0,
        "prompt_length/clip_ratio": 1 / 3,
    }
    # Unbiased variances: diff = [0]*7 + [1] -> (7/64 + 49/64) / 7 = 0.125;
    # returns: mean 5/8, squared deviations 3*(3/8)^2 + 4*(5/8)^2 + (11/8)^2 = 3.875 -> 3.875 / 7.
    expected["critic/vf_explained_var"] = 1 - 0.125 / (3.875 / 7 + 1e-5)
    assert set(m) == set(expected)
    for name, value in expected.items():
        assert m[name] == pytest.approx(value, abs=1e-6), name


def test_multi_turn_response_length_counts_tool_tokens() -> None:
    # Response 0: model, tool, tool, model (the attention mask's 4 tokens, cut at the limit); the
    # response mask holds the model's 2. The length and the cut follow rollout.response_length's count.
    b = _batch()
    b["response_mask"] = torch.tensor([[1, 0, 0, 1], [1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float32)
    b["attention_mask"][:, 3:] = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]])
    for key in ("advantages", "returns", "values"):
        del b[key]
    m = compute_data_metrics(b)
    assert m["response_length/mean"] == pytest.approx(8 / 3) and m["response_length/max"] == 4.0
    assert m["response_length/clip_ratio"] == pytest.approx(1 / 3)


def test_limits_override_the_tensor_widths() -> None:
    m = compute_data_metrics(_batch(), max_response_length=5, max_prompt_length=4)
    assert m["response_length/clip_ratio"] == 0.0
    assert m["prompt_length/clip_ratio"] == 0.0


def test_prompt_mask_key_and_optional_inputs() -> None:
    b = _batch()
    m = compute_data_metrics(
        {"response_mask": b["response_mask"], "prompt_mask": torch.tensor([[1, 1], [0, 1], [0, 1]])}
    )
    assert m["prompt_length/mean"] == pytest.approx(4 / 3)
    assert m["prompt_length/clip_ratio"] == pytest.approx(1 / 3)
    assert not any(k.startswith("critic/") for k in m)  # nothing to compute them from


def test_no_values_means_no_value_metrics() -> None:
    b = _batch()
    del b["values"]
    m = compute_data_metrics(b)
    assert "critic/values/mean" not in m and "critic/vf_explained_var" not in m


def test_empty_selection_gives_nan() -> None:
    m = compute_data_metrics({"response_mask": torch.zeros(2, 3), "advantages": torch.ones(2, 3)})
    assert math.isnan(m["critic/advantages/mean"])
    assert m["response_length/mean"] == 0.0


def test_bad_inputs_name_the_key() -> None:
    with pytest.raises(KeyError, match="response_mask"):
        compute_data_metrics({"advantages": torch.zeros(2, 3)})
    b = _batch()
    b["advantages"] = torch.zeros(3, 5)
    with pytest.raises(ValueError, match="'advantages'.*\\(3, 5\\)"):
        compute_data_metrics(b)
    b = _batch()
    b["attention_mask"] = torch.ones(3, 2)
    with pytest.raises(ValueError, match="attention_mask"):
        compute_data_metrics(b)


def test_count_tokens() -> None:
    # prompt tokens 2 + 3 + 1, response tokens 3 + 4 + 1
    assert count_tokens(_batch()) == (14, 8)


def test_timing_metrics_per_token_uses_response_tokens_for_gen() -> None:
    m = compute_timing_metrics({"gen": 2.0, "update_actor": 1.0, "step": 4.0}, num_tokens=1000, num_response_tokens=400)
    assert m == pytest.approx(
        {
            "timing_s/gen": 2.0, "timing_s/update_actor": 1.0, "timing_s/step": 4.0,
            "timing_per_token_ms/gen": 5.0,  # 2000 ms / 400 generated tokens
            "timing_per_token_ms/update_actor": 1.0,  # 1000 ms / 1000 tokens
            "timing_per_token_ms/step": 4.0,
        }
    )
    assert compute_timing_metrics({"gen": 1.0}, num_tokens=0) == {"timing_s/gen": 1.0}


def test_throughput_is_per_device() -> None:
    assert compute_throughput(1200, 2.0, 3) == pytest.approx(
        {"perf/total_num_tokens": 1200.0, "perf/time_per_step": 2.0, "perf/throughput": 200.0}
    )
    with pytest.raises(ValueError, match="step_time"):
        compute_throughput(10, 0.0, 1)
    with pytest.raises(ValueError, match="n_devices"):
        compute_throughput(10, 1.0, 0)


def test_reduce_metrics_means() -> None:
    records = [{"a": 1.0, "b": torch.tensor(2.0)}, {"a": 3}]
    assert reduce_metrics(records) == pytest.approx({"a": 2.0, "b": 2.0})
    assert reduce_metrics({"a": [1, 2, 6], "empty": []}) == pytest.approx({"a": 3.0})
