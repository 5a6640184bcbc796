"""The weight-sync probe's prompts (`rollout.probe_freq`): the first `rollout.probe_prompts` rows of
the training data, the same whatever the loader's shuffling; too many is a named error before any
worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_helpers import row, write_rows
from omegaconf import OmegaConf
from transformers import PreTrainedTokenizerBase

from megarl.data.dataset import RLDataset
from megarl.errors import ConfigError
from megarl.trainer.setup import probe_prompts

pytestmark = pytest.mark.unit

CONTENTS = ["3+4=", "12+3=", "7+8=", "0+0=", "9+9="]


def _cfg(files: list[str], freq: int, prompts: int) -> object:
    return OmegaConf.create({"rollout": {"probe_freq": freq, "probe_prompts": prompts}, "data": {"train_files": files}})


def test_probe_prompts_are_the_first_training_rows(tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase,
                                                   cache_dir: str) -> None:
    files = [write_rows(tmp_path / "train.parquet", [row(c, answer=str(i), index=i) for i, c in enumerate(CONTENTS)])]
    dataset = RLDataset(files, char_tokenizer, max_prompt_length=8, cache_dir=cache_dir)
    assert probe_prompts(_cfg(files, 0, 3), dataset) is None
    batch = probe_prompts(_cfg(files, 2, 3), dataset)
    assert len(batch) == 3 and list(batch["uid"]) == ["probe-0", "probe-1", "probe-2"]
    texts = [char_tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
    assert texts == CONTENTS[:3]
    assert list(batch["ground_truth"]) == ["0", "1", "2"]
    with pytest.raises(ConfigError, match=r"rollout.probe_prompts = 6: the training data \(.*train.parquet\) has only "
                                          r"5 prompts; valid: 1 to 5"):
        probe_prompts(_cfg(files, 1, 6), dataset)
