"""Reward-model scores on the driver: rows routed by `reward_model.style`, rule and model scores
combined, and the re-tokenised input of a reward model with another vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megarl.data.tokenizer import build_char_tokenizer
from megarl.errors import ConfigError, DataError
from megarl.protocol import Batch
from megarl.rewards.manager import RewardResult
from megarl.rewards.model_scores import (
    RewardCombine,
    combine_scores,
    reward_model_inputs,
    reward_model_tokenizer,
    row_styles,
    score_metrics,
)

pytestmark = pytest.mark.unit

STYLES = np.array(["rule", "model", "rule", "model"], dtype=object)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float32)
MODEL = torch.tensor([0.5, -1.0, 2.0, 3.0])


def _rule_result() -> RewardResult:
    """What the rule scorers return for the two rule rows (0 and 2)."""
    scores = torch.tensor([1.0, 0.0])
    return RewardResult(torch.zeros(2, 3), scores, {"score": np.array([1.0, 0.0]), "acc": np.array([1.0, 0.0])},
                        {"reward/time_s": 0.1})


def test_by_style_takes_the_rule_score_on_rule_rows_and_the_model_score_on_model_rows() -> None:
    combine = RewardCombine("by_style")
    rule_rows = combine.rule_rows(STYLES)
    assert rule_rows.tolist() == [True, False, True, False]
    out = combine_scores(_rule_result(), rule_rows, MODEL, STYLES, combine, MASK)
    assert out.scores.tolist() == [1.0, -1.0, 0.0, 3.0]
    # On the last response token; the empty response (row 3) gets nothing.
    want = torch.tensor([[0, 1.0, 0], [-1.0, 0, 0], [0, 0, 0.0], [0, 0, 0]])
    assert torch.equal(out.token_level_scores, want)
    assert out.reward_info["acc"].tolist() == [1.0, 0.0, 0.0, 0.0]  # 0 where the rule did not judge
    assert out.reward_info["rm_score"].tolist() == [0.5, -1.0, 2.0, 3.0]
    assert out.metrics["reward_model/score/mean"] == pytest.approx(1.125)
    assert out.metrics["reward_model/score/max"] == 3.0 and out.metrics["reward_model/score/min"] == -1.0
    assert out.metrics["reward/time_s"] == 0.1


def test_weighted_sum_adds_the_weighted_model_score_to_every_row() -> None:
    combine = RewardCombine("weighted_sum", rule_weight=2.0, model_weight=0.5)
    out = combine_scores(_rule_result(), combine.rule_rows(STYLES), MODEL, STYLES, combine, MASK)
    assert out.scores.tolist() == [2.0 * 1.0 + 0.25, -0.5, 0.0 + 1.0, 1.5]


def test_only_model_rows_need_no_rule_result() -> None:
    styles = np.array(["model", "model"], dtype=object)
    combine = RewardCombine("by_style")
    out = combine_scores(None, combine.rule_rows(styles), torch.tensor([1.5, -2.0]), styles, combine, MASK[:2])
    assert out.scores.tolist() == [1.5, -2.0] and set(out.reward_info) == {"rm_score"}


def test_styles_of_a_batch_and_bad_values() -> None:
    batch = Batch.from_dict({"x": torch.zeros(3)}, {"reward_style": ["rule", None, "model"],
                                                    "data_source": ["a", "b", "c"]})
    assert row_styles(batch).tolist() == ["rule", "rule", "model"]  # a row without a style: rule
    assert row_styles(Batch.from_dict({"x": torch.zeros(2)})).tolist() == ["rule", "rule"]
    bad = Batch.from_dict({"x": torch.zeros(2)}, {"reward_style": ["rule", "human"], "data_source": ["a", "b"]})
    with pytest.raises(DataError, match=r"reward_model.style = 'human' in batch row 1 \(data_source 'b'\); "
                                        r"valid: \['rule', 'model'\]"):
        row_styles(bad)
    with pytest.raises(ConfigError, match="reward_model.combine = 'max'"):
        RewardCombine("max")
    assert score_metrics(torch.zeros(0)) == {}


def test_a_reward_model_with_another_vocabulary_gets_its_own_tokens(tmp_path: Path) -> None:
    actor = build_char_tokenizer("0123456789+=", tmp_path / "actor")
    template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    rm_dir = tmp_path / "rm"
    build_char_tokenizer("=+9876543210:;ua", rm_dir, chat_template=template)
    rm = reward_model_tokenizer(str(rm_dir), actor)
    assert rm is not None
    same = tmp_path / "same"
    build_char_tokenizer("0123456789+=", same)
    assert reward_model_tokenizer(str(same), actor) is None  # same ids: the rollout's tokens are used
    assert reward_model_tokenizer(str(tmp_path), actor) is None  # no tokenizer of its own

    def ids(tok, text: str) -> list[int]:
        return tok.convert_tokens_to_ids(list(text))

    prompts = [ids(actor, "3+4="), ids(actor, "12+3=")]
    responses = [ids(actor, "7") + [actor.eos_token_id], ids(actor, "15")]
    width_p, width_r = 5, 2
    prompt_t = torch.tensor([[0] * (width_p - len(p)) + p for p in prompts])
    resp_t = torch.tensor([r[:width_r] + [0] * (width_r - len(r[:width_r])) for r in responses])
    resp_mask = torch.tensor([[1, 1], [1, 1]], dtype=torch.float32)
    batch = Batch.from_dict(
        {"prompts": prompt_t, "responses": resp_t, "response_mask": resp_mask,
         "input_ids": torch.cat([prompt_t, resp_t], 1),
         "attention_mask": torch.cat([(prompt_t != 0).long(), resp_mask.long()], 1)},
        {"raw_prompt": [[{"role": "user", "content": "3+4="}], [{"role": "user", "content": "12+3="}]]})
    out = reward_model_inputs(batch, actor, rm)
    # The EOS is a special token: decoding drops it, as verl does before re-tokenising.
    want = [ids(rm, "u:3+4=;a:7;"), ids(rm, "u:12+3=;a:15;")]
    assert out["responses"].shape == (2, 0)
    for row, expected in enumerate(want):
        n = int(out["attention_mask"][row].sum())
        assert out["input_ids"][row, :n].tolist() == expected
        assert out["attention_mask"][row, :n].all() and not out["attention_mask"][row, n:].any()
    # Without a tokenizer of its own, the rollout's own columns go as they are.
    same_ids = reward_model_inputs(batch, actor, None)
    assert torch.equal(same_ids["input_ids"], batch["input_ids"]) and same_ids["responses"].shape == (2, 2)
