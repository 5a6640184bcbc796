"""`reward_model.*`: a bad reward-model checkpoint is refused before any worker starts (with the
other files a run reads: `check_run_files`), naming the file and what was expected; `megarl config
validate` reports the same, and `--schema-only` leaves the checkpoint unread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file, save_file

from megarl.cli import main as cli_main
from megarl.config import load_config
from megarl.config.run_files import check_run_files
from megarl.data.tokenizer import build_char_tokenizer
from megarl.errors import ConfigError

pytestmark = pytest.mark.unit

HF = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def _experiment(tmp_path: Path, rm_dir: Path, tokenizer_dir: Path) -> Path:
    exp = {
        "data": {"train_files": ["train.parquet"], "tokenizer": str(tokenizer_dir), "train_batch_size": 4,
                 "max_prompt_length": 16, "max_response_length": 8},
        "model": {"hf_config": {"model_type": "qwen2", **HF}},
        "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2},
        "rollout": {"n": 2},
        "reward_model": {"enable": True, "model_path": str(rm_dir)},
        "resources": {"actor_pool": {"nnodes": 1, "devices_per_node": 2}},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def _save_rm(path: Path, num_labels: int = 1, **overrides: object) -> Path:
    config = transformers.Qwen2Config(**{**HF, **overrides}, num_labels=num_labels, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    build_char_tokenizer("0123456789+=", tmp_path / "tok")  # 4 special + 12 = 16 ids
    return tmp_path / "tok"


def _errors(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        check_run_files(load_config(path))  # train.parquet is absent too: named beside the reward model
    assert "data.train_files[0]" in str(info.value)
    return str(info.value)


def test_a_good_reward_model_validates_and_its_keys_resolve(tmp_path: Path, tokenizer_dir: Path) -> None:
    rm = _save_rm(tmp_path / "rm")
    cfg = load_config(_experiment(tmp_path, rm, tokenizer_dir),
                      ["reward_model.combine=weighted_sum", "reward_model.rule_weight=0.5",
                       "resources.reward_model_pool.devices_per_node=1",
                       "reward_model.megatron={tensor_model_parallel_size: 1}"])
    assert cfg.reward_model.combine == "weighted_sum" and cfg.resources.reward_model_pool.devices_per_node == 1


def test_missing_model_path_and_bad_combine(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = _experiment(tmp_path, tmp_path / "rm", tokenizer_dir)
    with pytest.raises(ConfigError) as info:
        load_config(path, ["reward_model.model_path=null", "reward_model.combine=product"])
    msg = str(info.value)
    assert "reward_model.enable = true needs reward_model.model_path" in msg
    assert "reward_model.combine = 'product'; valid: ['by_style', 'weighted_sum']" in msg


def test_checkpoint_without_a_score_head(tmp_path: Path, tokenizer_dir: Path) -> None:
    rm = _save_rm(tmp_path / "rm")
    weights = load_file(rm / "model.safetensors")
    del weights["score.weight"]
    save_file(weights, rm / "model.safetensors")
    msg = _errors(_experiment(tmp_path, rm, tokenizer_dir))
    assert f"{rm}: no 'score.weight' score head in its weights" in msg and "[1, hidden_size = 32]" in msg


def test_checkpoint_with_two_labels(tmp_path: Path, tokenizer_dir: Path) -> None:
    rm = _save_rm(tmp_path / "rm", num_labels=2)
    msg = _errors(_experiment(tmp_path, rm, tokenizer_dir))
    assert f"{rm / 'config.json'}: the model has 2 labels; a reward model has num_labels = 1" in msg
    assert f"{rm / 'model.safetensors'}: 'score.weight' has shape [2, 32]" in msg


def test_causal_lm_is_not_a_reward_model(tmp_path: Path, tokenizer_dir: Path) -> None:
    config = transformers.Qwen2Config(**HF)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "lm", safe_serialization=True)
    msg = _errors(_experiment(tmp_path, tmp_path / "lm", tokenizer_dir))
    assert "architectures = ['Qwen2ForCausalLM']; a reward model is a <Family>ForSequenceClassification" in msg


def test_vocabulary_that_does_not_fit(tmp_path: Path, tokenizer_dir: Path) -> None:
    rm = _save_rm(tmp_path / "rm", vocab_size=8)  # the actor's tokenizer has 16 ids
    msg = _errors(_experiment(tmp_path, rm, tokenizer_dir))
    assert f"{rm / 'config.json'}: vocab_size = 8, but the actor's tokenizer (it has none of its own) has 16" in msg
    build_char_tokenizer("0123456789+=abc", rm)  # its own tokenizer: 19 ids
    msg = _errors(_experiment(tmp_path, rm, tokenizer_dir))
    assert "vocab_size = 8, but its own tokenizer has 19 token ids" in msg


def test_colocated_reward_model_follows_the_actor_layout(tmp_path: Path, tokenizer_dir: Path) -> None:
    rm = _save_rm(tmp_path / "rm")
    with pytest.raises(ConfigError, match="reward_model.megatron differs from actor.megatron"):
        load_config(_experiment(tmp_path, rm, tokenizer_dir), ["reward_model.megatron={tensor_model_parallel_size: 2}"])


def test_config_validate_command_reports_it(tmp_path: Path, tokenizer_dir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rm = _save_rm(tmp_path / "rm", num_labels=3)
    assert cli_main(["config", "validate", str(_experiment(tmp_path, rm, tokenizer_dir))]) == 1
    assert "the model has 3 labels" in capsys.readouterr().err
    # The config alone: a recipe whose reward model is not on this machine validates.
    absent = _experiment(tmp_path, tmp_path / "not_fitted_yet", tokenizer_dir)
    assert cli_main(["config", "validate", str(absent), "--schema-only"]) == 0
    assert "valid (files not checked)" in capsys.readouterr().out
    assert cli_main(["config", "validate", str(absent)]) == 1
    assert "not_fitted_yet" in capsys.readouterr().err
    assert json.loads((rm / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]


def test_a_converted_reward_model_has_its_layout_checked_too(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A reward model converted with `megarl convert hf-to-mcore` keeps its config in `hf/`: the
    layout rules read it there (they read `<path>/config.json`, found none and checked nothing; the
    worker then failed on the layout after Ray had started)."""
    from megarl.convert.hf_to_mcore import convert_hf_to_mcore

    rm = convert_hf_to_mcore(_save_rm(tmp_path / "rm_hf"), tmp_path / "rm_mcore", progress=False).out_dir
    exp = _experiment(tmp_path, rm, tokenizer_dir)
    overrides = ["resources.reward_model_pool={nnodes: 1, devices_per_node: 3}",
                 "reward_model.megatron={tensor_model_parallel_size: 3}"]
    with pytest.raises(ConfigError, match="num_attention_heads = 4"):  # 4 heads over 3 ranks
        load_config(exp, overrides)
    with pytest.raises(ConfigError, match="num_attention_heads = 4"):  # the same rule as for the HF directory
        load_config(_experiment(tmp_path, tmp_path / "rm_hf", tokenizer_dir), overrides)
