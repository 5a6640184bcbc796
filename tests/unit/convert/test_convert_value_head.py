"""A value or reward model has one scalar head, `score.weight` [1, hidden_size]: a classifier of more
labels is refused by hf-to-mcore, naming num_labels and the head's shape, before anything is written
(rather than converted, then refused by the engine and by mcore-to-hf)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tiny_hf import save_model

from megarl.convert.cli import main as convert_main
from megarl.convert.hf_to_mcore import convert_hf_to_mcore
from megarl.errors import ConfigError


def _classifier(path: Path, labels: int) -> Path:
    config = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_labels=labels,
                                      pad_token_id=0)
    torch.manual_seed(0)
    return save_model(transformers.Qwen2ForSequenceClassification(config).eval(), path)


@pytest.mark.parametrize("labels", [2, 3])
def test_a_classifier_of_several_labels_is_refused(tmp_path: Path, labels: int,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    src = _classifier(tmp_path / "hf", labels)
    with pytest.raises(ConfigError) as err:
        convert_hf_to_mcore(src, tmp_path / "mc", progress=False)
    assert str(err.value).startswith(
        f"{src / 'config.json'}: a Qwen2ForSequenceClassification with num_labels = {labels} (score.weight of shape "
        f"[{labels}, 64]); a value or reward model has one label, score.weight of shape [1, 64]")
    assert not (tmp_path / "mc").exists() and [p.name for p in tmp_path.iterdir()] == ["hf"]
    capsys.readouterr()
    assert convert_main(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "mc"), "--quiet"]) == 1
    out = capsys.readouterr().err
    assert out.startswith("error: ") and f"num_labels = {labels}" in out and "Traceback" not in out


def test_one_label_converts(tmp_path: Path) -> None:
    convert_hf_to_mcore(_classifier(tmp_path / "hf", 1), tmp_path / "mc", progress=False)
    assert (tmp_path / "mc" / "metadata.json").is_file()
