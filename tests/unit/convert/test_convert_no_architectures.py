"""A HF directory whose config.json names no `architectures` (`PretrainedConfig.save_pretrained` of a
config made on its own writes null): transformers loads it by its model_type, and so does the
conversion, taking the class its family lists, in the head its weights have."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tiny_hf import make_model, read_all, save_model

from megarl.convert.cli import main as convert_main
from megarl.convert.dcp_io import CheckpointReader
from megarl.convert.mcore_to_hf import convert_mcore_to_hf
from megarl.trainer.checkpoint_verify import verify_checkpoint


def _without_architectures(path: Path, how: str) -> Path:
    config = json.loads((path / "config.json").read_text())
    if how == "null":
        config["architectures"] = None
    else:
        del config["architectures"]
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("how", ["null", "absent"])
def test_a_causal_lm_without_architectures_converts_and_exports(tmp_path: Path, how: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    src = _without_architectures(save_model(make_model("llama", seed=3), tmp_path / "hf"), how)
    loaded_as = type(transformers.AutoModelForCausalLM.from_pretrained(src)).__name__
    assert convert_main(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "mc"), "--tp", "2", "--quiet"]) == 0, \
        capsys.readouterr().err
    assert CheckpointReader(tmp_path / "mc").common()["megarl"]["role"] == "policy"
    report = verify_checkpoint(tmp_path / "mc")
    assert report.ok, report.message()
    assert convert_main(["mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "back"),
                         "--quiet"]) == 0, capsys.readouterr().err
    want, got = read_all(src), read_all(tmp_path / "back")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [loaded_as]


def test_a_sequence_classifier_without_architectures_converts_as_a_value_model(tmp_path: Path) -> None:
    config = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Qwen2ForSequenceClassification(config).eval()
    src = _without_architectures(save_model(model, tmp_path / "hf"), "null")
    loaded_as = type(transformers.AutoModelForSequenceClassification.from_pretrained(src)).__name__
    assert convert_main(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "mc"), "--quiet"]) == 0
    reader = CheckpointReader(tmp_path / "mc")
    assert reader.common()["megarl"]["role"] == "value"
    assert torch.equal(reader.read("output_layer.weight"), model.score.weight.detach())
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "back", progress=False)
    want, got = read_all(src), read_all(tmp_path / "back")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [loaded_as]
