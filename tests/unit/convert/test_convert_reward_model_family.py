"""A reward model converted with `--spec FAMILY` (a model_type no family lists) is built with the
family its checkpoint records, by the reward-model role and by the checks run before any worker
starts; a reward model no family maps fails those checks, not the worker."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from tiny_hf import save_model

from megarl.convert.hf_to_mcore import convert_hf_to_mcore
from megarl.errors import ConfigError
from megarl.models.spec import ModelSpec
from megarl.rewards.model_checkpoint import reward_model_problems, reward_model_spec


def _renamed_reward_model(path: Path) -> Path:
    """A Qwen2 reward model (one label) whose config says model_type 'my_qwen2_rm', as a fine-tuned
    variant may: no family lists it, transformers reads it with the architecture's config class."""
    config = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    save_model(transformers.Qwen2ForSequenceClassification(config).eval(), path)
    (path / "tokenizer_config.json").unlink()  # no tokenizer: the checks skip the vocabulary (none to compare)
    fields = json.loads((path / "config.json").read_text())
    fields["model_type"] = "my_qwen2_rm"
    (path / "config.json").write_text(json.dumps(fields))
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rm")
    convert_hf_to_mcore(_renamed_reward_model(root / "hf"), root / "mc", progress=False, family="qwen2")
    return root / "mc"


def test_the_role_builds_the_family_the_checkpoint_records(converted: Path) -> None:
    # Without the recorded family the config maps to no family at all.
    with pytest.raises(ConfigError, match=r"unsupported architecture model_type='my_qwen2_rm'"):
        ModelSpec.from_hf_config(converted / "hf")
    spec = reward_model_spec(converted)
    assert spec.family == "qwen2" and spec.features["qkv_bias"]
    # The recorded family wins over the one the role is given: the weights are laid out by it.
    assert reward_model_spec(converted, family="llama").family == "qwen2"
    assert reward_model_problems(str(converted), None) == []


def test_a_reward_model_no_family_maps_fails_the_checks_before_the_run(tmp_path: Path) -> None:
    src = _renamed_reward_model(tmp_path / "hf")
    problems = reward_model_problems(str(src), None)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"reward_model.model_path = {str(src)!r}: {src / 'config.json'}: unsupported "
                                  "architecture model_type='my_qwen2_rm'")


def test_a_checkpoint_recording_an_unknown_family_fails_the_checks(converted: Path, tmp_path: Path) -> None:
    ckpt = Path(shutil.copytree(converted, tmp_path / "mc"))
    common = torch.load(ckpt / "common.pt", weights_only=False)
    common["megarl"]["family"] = "qwen9"
    torch.save(common, ckpt / "common.pt")
    problems = reward_model_problems(str(ckpt), None)
    assert len(problems) == 1 and "model spec 'qwen9': no such family" in problems[0], problems
