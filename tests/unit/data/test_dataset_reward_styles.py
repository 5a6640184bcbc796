"""Rows judged by a reward model (`reward_model.style: model`): no ground truth needed, their data
sources need no rule scorer, and each batch row carries its style."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_helpers import row, write_rows

from megarl.data.dataset import RLDataset
from megarl.data.tokenizer import build_char_tokenizer
from megarl.errors import DataError

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


def test_without_a_reward_model_every_row_needs_its_ground_truth(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer("0123456789+=helo", tmp_path / "tok")
    path = write_rows(tmp_path / "mixed.parquet", _rows())
    with pytest.raises(DataError, match=r"mixed.parquet: row 1, column 'reward_model': has no 'ground_truth'"):
        RLDataset(path, tokenizer, max_prompt_length=8, apply_chat_template=False)
