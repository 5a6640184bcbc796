"""`model.override_config` over a checkpoint: the run's model directory has the merged config.json
and links to the checkpoint's other files, so every role and the rollout read the same config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from megarl.models.spec import ModelSpec
from megarl.trainer.setup import with_config_overrides

pytestmark = pytest.mark.unit


def test_overrides_reach_the_model_spec_and_weights_are_linked(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    config = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 64, "rope_theta": 10000.0,
              "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "hidden_act": "silu"}
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "model.safetensors").write_bytes(b"weights")
    (ckpt / "tokenizer.json").write_text("{}")

    out = with_config_overrides(ckpt, {"rope_theta": 500000.0, "max_position_embeddings": 4096}, tmp_path / "run_model")

    assert json.loads((ckpt / "config.json").read_text())["rope_theta"] == 10000.0  # the checkpoint is untouched
    spec = ModelSpec.from_hf_config(out)
    assert spec.rotary_base == 500000.0 and spec.max_position_embeddings == 4096
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 500000.0
    assert (out / "model.safetensors").is_symlink() and (out / "model.safetensors").read_bytes() == b"weights"
    assert (out / "tokenizer.json").is_symlink()
    # Running again (a resumed run) keeps the links and rewrites the config.
    again = with_config_overrides(ckpt, {"rope_theta": 250000.0}, tmp_path / "run_model")
    assert ModelSpec.from_hf_config(again).rotary_base == 250000.0
