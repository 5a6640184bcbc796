"""RewardManager: token placement, overlong shaping, failure accounting, configuration."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from megarl.config.schema import RewardConfig
from megarl.data.tokenizer import build_char_tokenizer
from megarl.errors import ConfigError, DataError
from megarl.protocol.batch import Batch
from megarl.rewards.manager import RewardManager, last_valid_positions
from megarl.rewards.scorers import UnknownDataSourceError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

FNS = str(Path(__file__).with_name("user_reward_fns.py"))


def full_mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.tensor([[1] * n + [0] * (width - n) for n in lengths])


def test_last_valid_positions_hand_examples() -> None:
    mask = torch.tensor(
        [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]]
    )  # last row: a multi-turn hole
    assert last_valid_positions(mask).tolist() == [1, 3, -1, 2]


def test_builtin_scores_land_on_the_last_valid_token() -> None:
    manager = RewardManager()
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]])
    result = manager.score(
        ["7", "#### 12", "3*5+7", "9"],
        ["7", "12", {"target": 23, "numbers": [3, 5, 7]}, "9"],
        ["arithmetic", "openai/gsm8k", "countdown", "arithmetic"],
        None,
        None,
        mask,
    )
    expected = torch.tensor([[0, 1.0, 0, 0], [0, 0, 0, 1.0], [0, 0, 0.1, 0], [0, 0, 0, 0]])
    assert result.token_level_scores.dtype == torch.float32
    assert torch.allclose(result.token_level_scores, expected)
    assert torch.allclose(result.scores, torch.tensor([1.0, 1.0, 0.1, 1.0]))
    assert result.reward_info["acc"].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert result.reward_info["format"].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert result.reward_info["failed"].tolist() == [0.0] * 4
    assert result.metrics["reward/num_empty_responses"] == 1.0  # its score has no token to sit on
    assert result.metrics["reward/num_failed"] == 0.0


def test_overlong_shaping_counts_tool_tokens_of_a_multi_turn_response(tmp_path: Path) -> None:
    # Model tokens "7", a 5-token tool output (response_mask 0, attention_mask 1), "7", EOS: the
    # response is 8 tokens long against the cap of 10, 3 of them the model's.
    tokenizer = build_char_tokenizer("0123456789+=", tmp_path)
    seven, eos = tokenizer.convert_tokens_to_ids("7"), tokenizer.eos_token_id
    responses = torch.tensor([[seven] + [seven] * 5 + [seven, eos, 0, 0]])
    mask = torch.tensor([[1, 0, 0, 0, 0, 0, 1, 1, 0, 0]])
    attention = torch.cat([torch.ones(1, 3, dtype=torch.long), torch.tensor([[1] * 8 + [0, 0]])], dim=1)
    batch = Batch.from_dict({"responses": responses, "response_mask": mask, "attention_mask": attention},
                            non_tensors={"ground_truth": ["77"], "data_source": ["arithmetic"], "extra_info": [{}]})
    manager = RewardManager(overlong_enable=True, overlong_buffer_len=4, overlong_penalty_factor=1.0,
                            max_response_length=10)
    result = manager.score_batch(batch, tokenizer)
    assert result.reward_info["overlong_penalty"].tolist() == pytest.approx([-(8 - 6) / 4])


def test_overlong_penalty_matches_the_dapo_formula() -> None:
    # max 10, buffer 4: no penalty up to 6 tokens, then -(len-6)/4 * factor.
    manager = RewardManager(
        overlong_enable=True, overlong_buffer_len=4, overlong_penalty_factor=0.5, max_response_length=10
    )
    lengths = [5, 6, 8, 10]
    result = manager.score(
        ["7", "7", "7", "8"], ["7"] * 4, ["arithmetic"] * 4, None, None, full_mask(lengths, 10)
    )
    penalty = [0.0, 0.0, -(8 - 6) / 4 * 0.5, -(10 - 6) / 4 * 0.5]
    assert result.reward_info["overlong_penalty"].tolist() == pytest.approx(penalty)
    assert result.scores.tolist() == pytest.approx([1.0, 1.0, 0.75, -0.5])
    assert result.reward_info["score"].tolist() == [1.0, 1.0, 1.0, 0.0]  # before shaping
    assert result.token_level_scores[2, 7].item() == pytest.approx(0.75)
    assert result.token_level_scores[3, 9].item() == pytest.approx(-0.5)
    assert result.metrics["reward/overlong_ratio"] == 0.5
    # Explicit lengths take precedence over the mask.
    explicit = manager.score(["7"], ["7"], ["arithmetic"], None, torch.tensor([10]), full_mask([1], 10))
    assert explicit.scores.tolist() == pytest.approx([1.0 - 0.5])


def test_overlong_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="max_response_length"):
        RewardManager(overlong_enable=True, overlong_buffer_len=4)
    with pytest.raises(ConfigError, match="overlong_buffer.len"):
        RewardManager(overlong_enable=True, overlong_buffer_len=0, max_response_length=10)


def test_unknown_data_source_lists_the_known_ones() -> None:
    manager = RewardManager()
    with pytest.raises(UnknownDataSourceError, match="'mystery'.*'arithmetic'.*custom_reward_function"):
        manager.score(["1"], ["1"], ["mystery"], None, None, full_mask([1], 2))
    with pytest.raises(UnknownDataSourceError):
        manager.check_data_sources(["arithmetic", "mystery"])


def test_builtin_options_and_validation() -> None:
    exact = RewardManager(reward_kwargs={"arithmetic": {"mode": "exact"}})
    assert exact.score(["7+1"], ["7"], ["arithmetic"], None, None, full_mask([3], 3)).scores.tolist() == [0.0]
    assert RewardManager().score(
        ["7+1"], ["7"], ["arithmetic"], None, None, full_mask([3], 3)
    ).scores.tolist() == [1.0]
    with pytest.raises(ConfigError, match="reward_kwargs.arithmetic"):
        RewardManager(reward_kwargs={"arithmetic": {"strict": True}})


def test_builtin_scorer_exception_is_a_counted_failure() -> None:
    # 1 of 1 calls failed: above the default max_failure_share, so the rule is turned off here.
    result = RewardManager(max_failure_share=1.0).score(
        ["7"], ["not a number"], ["arithmetic"], None, None, full_mask([1], 1)
    )
    assert result.scores.tolist() == [0.0] and result.metrics["reward/num_error"] == 1.0
    assert result.reward_info["failed"].tolist() == [1.0]


def test_isolated_builtins_match_in_process() -> None:
    texts = ["7", "72", "#### 5", "\\boxed{\\frac12}", "3*5+7"]
    truths = ["7", "7", "5", "0.5", {"target": 22, "numbers": [3, 5, 7]}]
    sources = ["arithmetic", "arithmetic", "gsm8k", "math", "countdown"]
    mask = full_mask([1, 2, 3, 4, 5], 5)
    local = RewardManager().score(texts, truths, sources, None, None, mask)
    with RewardManager(isolate_builtin=True, num_workers=2) as isolated:
        remote = isolated.score(texts, truths, sources, None, None, mask)
    assert torch.equal(local.token_level_scores, remote.token_level_scores)
    assert {k: v.tolist() for k, v in local.reward_info.items()} == {
        k: v.tolist() for k, v in remote.reward_info.items()
    }


def test_custom_function_failures_are_counted_logged_and_scored_zero(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with RewardManager(
        custom_fn_path=FNS, custom_fn_name="raises_on_bad", num_workers=2, timeout_s=5.0
    ) as manager:
        with caplog.at_level(logging.WARNING, logger="megarl.rewards.manager"):
            result = manager.score(
                ["ok", "bad", "ok", "exit"],
                ["1"] * 4,
                ["anything"] * 4,
                None,
                None,
                full_mask([1, 1, 1, 1], 2),
            )
    assert result.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert result.reward_info["failed"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert result.metrics["reward/num_error"] == 2.0 and result.metrics["reward/num_failed"] == 2.0
    assert "sample 1" in caplog.text and "boom in user code" in caplog.text


def test_custom_function_timeouts_crashes_and_garbage() -> None:
    with RewardManager(
        custom_fn_path=FNS, custom_fn_name="hangs_on_hang", num_workers=2, timeout_s=0.5
    ) as manager:
        result = manager.score(
            ["ok", "hang", "ok"], ["1"] * 3, ["x"] * 3, None, None, full_mask([1, 1, 1], 1)
        )
    assert result.scores.tolist() == [1.0, 0.0, 1.0]
    assert result.metrics["reward/num_timeout"] == 1.0 and result.metrics["reward/worker_restarts"] == 1.0
    with RewardManager(
        custom_fn_path=FNS, custom_fn_name="garbage", num_workers=1, max_failure_share=1.0
    ) as manager:
        result = manager.score(
            ["nan", "str", "numpy"], ["1"] * 3, ["x"] * 3, None, None, full_mask([1, 1, 1], 1)
        )
    assert result.scores.tolist() == [0.0, 0.0, 0.25]
    assert result.metrics["reward/num_bad_return"] == 2.0


def test_custom_function_gets_kwargs_and_ignores_data_source_dispatch() -> None:
    with RewardManager(
        custom_fn_path=FNS, custom_fn_name="exact_match", reward_kwargs={"bonus": 0.5}, num_workers=1
    ) as manager:
        manager.check_data_sources(["anything/at/all"])
        result = manager.score(
            ["1", "2"], ["1", "1"], ["anything/at/all"] * 2, [{}, {}], None, full_mask([1, 1], 1)
        )
    assert result.scores.tolist() == [1.5, 0.5]
    assert result.reward_info["acc"].tolist() == [1.0, 0.0]


def test_from_config_and_bad_config() -> None:
    config = RewardConfig()
    config.custom_reward_function.path = FNS
    config.custom_reward_function.name = "exact_match"
    config.num_workers = 1
    config.overlong_buffer.enable = True
    config.overlong_buffer.len = 2
    with RewardManager.from_config(config, max_response_length=4) as manager:
        result = manager.score(["1"], ["1"], ["x"], None, None, full_mask([4], 4))
    assert result.scores.tolist() == [0.0]  # 1 - (4 - 2) / 2
    config.custom_reward_function.path = "/nonexistent/reward.py"
    with pytest.raises(ConfigError, match="does not exist"):
        RewardManager.from_config(config, max_response_length=4)


def test_config_options_reach_the_scorers_as_plain_python() -> None:
    """The experiment config's reward_kwargs (OmegaConf nodes) become dicts and lists, all the way
    down, with interpolations resolved; the scores are those of the same options given as dicts."""
    node = OmegaConf.create({"mode": "startswith", "reward_kwargs": {"arithmetic": {"mode": "${mode}"},
                                                                     "nested": {"xs": [1, {"y": [2, 3]}]}}})
    with RewardManager(reward_kwargs=node.reward_kwargs, custom_fn_path=FNS, custom_fn_name="exact_match",
                       num_workers=1) as manager:
        plain = manager.reward_kwargs
    assert plain == {"arithmetic": {"mode": "startswith"}, "nested": {"xs": [1, {"y": [2, 3]}]}}

    def containers(value):
        if isinstance(value, dict):
            return [type(value)] + [t for item in value.values() for t in containers(item)]
        if isinstance(value, list):
            return [type(value)] + [t for item in value for t in containers(item)]
        return []

    assert not any(issubclass(t, (DictConfig, ListConfig)) for t in containers(plain))

    config = OmegaConf.structured(RewardConfig())
    config.reward_kwargs = {"arithmetic": {"mode": "startswith"}}
    assert isinstance(config.reward_kwargs.arithmetic, DictConfig)  # what a run's config hands over
    responses, truths = ["3", "34", "4", "x3"], ["3", "3", "3", "3"]
    with RewardManager.from_config(config, max_response_length=4) as from_node, \
            RewardManager(reward_kwargs={"arithmetic": {"mode": "startswith"}}, max_response_length=4) as from_dict:
        assert type(from_node.reward_kwargs["arithmetic"]) is dict
        got = from_node.score(responses, truths, ["arithmetic"] * 4, None, None, full_mask([1, 2, 1, 2], 2))
        want = from_dict.score(responses, truths, ["arithmetic"] * 4, None, None, full_mask([1, 2, 1, 2], 2))
    assert got.scores.tolist() == want.scores.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_mismatched_inputs_are_data_errors() -> None:
    with pytest.raises(DataError, match="ground_truths has 1 entries for 2 responses"):
        RewardManager().score(["1", "2"], ["1"], ["arithmetic"] * 2, None, None, full_mask([1, 1], 1))
    with pytest.raises(DataError, match="response_mask"):
        RewardManager().score(["1"], ["1"], ["arithmetic"], None, None, torch.ones(2, 3))


def test_score_batch_decodes_responses(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer("0123456789+=", tmp_path)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    seven, two = tokenizer.convert_tokens_to_ids("7"), tokenizer.convert_tokens_to_ids("2")
    responses = torch.tensor([[seven, eos, pad, pad], [seven, two, eos, pad]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    batch = Batch.from_dict(
        {"responses": responses, "response_mask": mask},
        non_tensors={"ground_truth": ["7", "7"], "data_source": ["arithmetic"] * 2, "extra_info": [{}, {}]},
    )
    result = RewardManager().score_batch(batch, tokenizer)
    assert result.scores.tolist() == [1.0, 0.0]  # "7" right; "72" is not 7
    assert result.token_level_scores.tolist() == [[0, 1.0, 0, 0], [0, 0, 0, 0]]
    assert np.array_equal(result.reward_info["format"], [1.0, 1.0])
