"""dump_rollouts / dump_validation: decoded texts and per-sequence numbers of each generated row."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from megarl.data.tokenizer import build_char_tokenizer, load_tokenizer
from megarl.protocol import Batch
from megarl.trainer.rollout_dump import dump_rollouts, dump_validation, write_jsonl_atomic

pytestmark = pytest.mark.unit

CHARS = "0123456789+-*= "
PAD, EOS = 0, 2  # <pad>=0, <bos>=1, <eos>=2, <unk>=3, then CHARS from id 4


def ids(text: str) -> list[int]:
    return [4 + CHARS.index(ch) for ch in text]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    out = tmp_path_factory.mktemp("char_tokenizer")
    build_char_tokenizer(CHARS, out)
    return load_tokenizer(out)


def rollout_batch() -> Batch:
    """2 prompts x 2 samples; prompts left-padded to P=4, responses right-padded to R=4."""
    prompt_a = ids("1+2=")
    prompt_b = [PAD, PAD, *ids("3=")]
    prompts = torch.tensor([prompt_a, prompt_a, prompt_b, prompt_b])
    prompt_mask = torch.tensor([[1, 1, 1, 1]] * 2 + [[0, 0, 1, 1]] * 2)
    responses = torch.tensor([
        [*ids("3"), EOS, PAD, PAD],        # "3" then EOS
        ids("44 4"),                       # cut at the length limit, no EOS
        [*ids("9"), EOS, *ids("77")],      # ids after the mask must not be decoded
        [PAD, PAD, PAD, PAD],              # empty response
    ])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    scores = torch.zeros(4, 4)
    scores[0, 1], scores[1, 3], scores[2, 1] = 1.0, -0.5, 0.25
    rewards = scores - 0.125 * response_mask  # as if a KL penalty of 0.125 per token
    advantages = torch.tensor([0.75, -0.75, 1.5, 9.0]).unsqueeze(1) * response_mask
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "input_ids": torch.cat([prompts, responses], dim=1),
        "token_level_scores": scores,
        "token_level_rewards": rewards,
        "advantages": advantages,
    }
    non_tensors = {
        "uid": ["a", "a", "b", "b"],
        "data_source": ["arith"] * 4,
        "ground_truth": ["3", "3", "5", "5"],
        "reward_info/acc": np.array([np.float64(1.0), np.float32(0.0), np.float64(0.0), np.nan], dtype=object),
        "reward_info/score": [1.0, -0.5, 0.25, 0.0],
        "reward_info/pred": ["3", "44 4", "9", None],
    }
    return Batch.from_dict(tensors, non_tensors)


def read_lines(path: Path) -> list[dict[str, Any]]:
    def reject(name: str) -> None:
        raise ValueError(f"non-strict JSON constant {name}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text(encoding="utf-8").splitlines()]


EXPECTED = [
    {"step": 7, "uid": "a", "input": "1+2=", "output": "3<eos>", "data_source": "arith", "ground_truth": "3",
     "score": 1.0, "reward": 0.75, "advantage": 0.75, "acc": 1.0, "reward_info/score": 1.0, "pred": "3",
     "response_length": 2},
    {"step": 7, "uid": "a", "input": "1+2=", "output": "44 4", "data_source": "arith", "ground_truth": "3",
     "score": -0.5, "reward": -1.0, "advantage": -0.75, "acc": 0.0, "reward_info/score": -0.5, "pred": "44 4",
     "response_length": 4},
    {"step": 7, "uid": "b", "input": "3=", "output": "9<eos>", "data_source": "arith", "ground_truth": "5",
     "score": 0.25, "reward": 0.0, "advantage": 1.5, "acc": 0.0, "reward_info/score": 0.25, "pred": "9",
     "response_length": 2},
    {"step": 7, "uid": "b", "input": "3=", "output": "", "data_source": "arith", "ground_truth": "5",
     "score": 0.0, "reward": 0.0, "advantage": None, "acc": None, "reward_info/score": 0.0, "pred": None,
     "response_length": 0},
]


def test_dump_rollouts_writes_one_decoded_line_per_response(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    out_dir = tmp_path / "rollouts"
    path = dump_rollouts(rollout_batch(), tokenizer, step=7, out_dir=out_dir)
    assert path == out_dir / "7.jsonl"
    assert sorted(p.name for p in out_dir.iterdir()) == ["7.jsonl"]  # no temporary file left
    lines = read_lines(path)
    assert lines == EXPECTED
    assert list(lines[0])[:3] == ["step", "uid", "input"]
    assert isinstance(lines[0]["response_length"], int) and isinstance(lines[0]["acc"], float)


def test_optional_columns_are_left_out(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    batch = rollout_batch().select("prompts", "responses", "attention_mask", "token_level_scores")
    lines = read_lines(dump_rollouts(batch, tokenizer, step=3, out_dir=tmp_path))
    # Without response_mask the response part of attention_mask is the mask.
    assert [line["output"] for line in lines] == ["3<eos>", "44 4", "9<eos>", ""]
    assert set(lines[0]) == {"step", "input", "output", "score", "response_length"}
    assert lines[2] == {"step": 3, "input": "3=", "output": "9<eos>", "score": 0.25, "response_length": 2}


def test_dump_validation_puts_all_batches_in_one_file(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    batch = rollout_batch()
    path = dump_validation([batch[2:4], batch[0:2]], tokenizer, step=5, out_dir=tmp_path / "val")
    assert path == tmp_path / "val" / "5.jsonl"
    lines = read_lines(path)
    assert [line["output"] for line in lines] == ["9<eos>", "", "3<eos>", "44 4"]
    assert {line["step"] for line in lines} == {5}


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "1.jsonl"
    path.write_text('{"old": 1}\n', encoding="utf-8")
    with pytest.raises(ValueError):
        write_jsonl_atomic([{"ok": 1}, {"bad": math.nan}], path)  # NaN is not strict JSON
    assert path.read_text(encoding="utf-8") == '{"old": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["1.jsonl"]
