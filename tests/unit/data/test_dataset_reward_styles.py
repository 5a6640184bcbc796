"""Rows judged by a reward model (`reward_model.style: model`): no ground truth needed, their data
sources need no rule scorer, and each batch row carries its style."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_helpers import row, write_rows
from omegaconf import OmegaConf

from megarl.data.dataset import RLDataset
from megarl.data.tokenizer import build_char_tokenizer
from megarl.errors import ConfigError, DataError
from megarl.trainer.setup import check_reward_model_rows

pytestmark = pytest.mark.unit


def _rows() -> list[dict]:
    rows = [row("1+2=", "3", index=0), row("hello", data_source="chat", index=1), row("2+2=", "4", index=2)]
    rows[1]["reward_model"] = {"style": "model", "ground_truth": None}
    return rows


def test_model_rows_need_no_ground_truth_and_carry_their_style(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer("0123456789+=helo", tmp_path / "tok")
    path = write_rows(tmp_path / "mixed.parquet", _rows())
    dataset = RLDataset(path, tokenizer, max_prompt_length=8, apply_chat_template=False, model_scored_rows=True)
    assert dataset.data_sources() == ["arithmetic", "chat"]
    assert dataset.rule_data_sources() == ["arithmetic"]
    batch = dataset.collate(dataset.get_rows([0, 1, 2]))
    assert list(batch["reward_style"]) == ["rule", "model", "rule"]
    assert list(batch["ground_truth"]) == ["3", None, "4"]


def test_a_named_rule_style_is_a_rule(tmp_path: Path) -> None:
    # Public datasets name the rule in the style: DAPO-Math-17k's rows say "rule-lighteval/MATH_v2".
    tokenizer = build_char_tokenizer("0123456789+=helo", tmp_path / "tok")
    rows = [row("1+2=", "3", index=0), row("2+2=", "4", index=1)]
    rows[0]["reward_model"]["style"] = "rule-lighteval/MATH_v2"
    dataset = RLDataset(write_rows(tmp_path / "named.parquet", rows), tokenizer, max_prompt_length=8,
                        apply_chat_template=False, model_scored_rows=True)
    assert list(dataset.collate(dataset.get_rows([0, 1]))["reward_style"]) == ["rule", "rule"]
    assert dataset.rule_data_sources() == ["arithmetic"] and not dataset.has_model_scored_rows()


def test_without_a_reward_model_every_row_needs_its_ground_truth(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer("0123456789+=helo", tmp_path / "tok")
    path = write_rows(tmp_path / "mixed.parquet", _rows())
    with pytest.raises(DataError, match=r"mixed.parquet: row 1, column 'reward_model': has no 'ground_truth'"):
        RLDataset(path, tokenizer, max_prompt_length=8, apply_chat_template=False)


def test_by_style_needs_rows_the_reward_model_judges(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer("0123456789+=helo", tmp_path / "tok")
    mixed = write_rows(tmp_path / "mixed.parquet", _rows())
    rule_only = write_rows(tmp_path / "rule.parquet", [row("1+2=", "3", index=0), row("2+2=", "4", index=1)])
    datasets = {path: RLDataset(path, tokenizer, max_prompt_length=8, apply_chat_template=False, model_scored_rows=True)
                for path in (mixed, rule_only)}
    assert [d.has_model_scored_rows() for d in datasets.values()] == [True, False]

    def cfg(path: Path, combine: str, enable: bool = True):
        return OmegaConf.create({"reward_model": {"enable": enable, "combine": combine},
                                 "data": {"train_files": [str(path)]}})

    check_reward_model_rows(cfg(mixed, "by_style"), datasets[mixed])
    check_reward_model_rows(cfg(rule_only, "weighted_sum"), datasets[rule_only])  # the model scores every row
    check_reward_model_rows(cfg(rule_only, "by_style", enable=False), datasets[rule_only])
    with pytest.raises(ConfigError) as err:
        check_reward_model_rows(cfg(rule_only, "by_style"), datasets[rule_only])
    assert (f"no row of data.train_files ({rule_only}) has reward_model.style 'model', so every row would be scored "
            "by rule") in str(err.value) and "reward_model.combine: weighted_sum" in str(err.value)


def test_a_misspelt_style_names_file_row_and_column_when_the_data_opens(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer("0123456789+=helo", tmp_path / "tok")
    rows = _rows()
    rows[1]["reward_model"]["ground_truth"] = "x"  # with or without a reward model, row 1 is fine
    rows[2]["reward_model"] = {"style": "Model", "ground_truth": "4"}
    path = write_rows(tmp_path / "typo.parquet", rows)
    for model_scored in (True, False):
        with pytest.raises(DataError, match=r"typo.parquet: row 2, column 'reward_model': style 'Model'; valid: "
                                            r"\['rule', 'model'\]"):
            RLDataset(path, tokenizer, max_prompt_length=8, apply_chat_template=False, model_scored_rows=model_scored)
