"""`reward_model.*` resolved into the reward model's role spec and the score combination."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
import yaml

from megarl.config import load_config
from megarl.layout import ParallelLayout
from megarl.rewards.model_scores import RewardCombine
from megarl.trainer.run_spec import resolve_run_spec
from megarl.workers.specs import OffloadSpec

pytestmark = pytest.mark.unit

MODEL = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 4, "intermediate_size": 128, "vocab_size": 64, "max_position_embeddings": 128}


def resolve(tmp_path: Path, *overrides: str):
    config = transformers.Qwen2Config(**{k: v for k, v in MODEL.items() if k != "model_type"}, num_labels=1)
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(tmp_path / "rm", safe_serialization=True)
    exp = {
        "data": {"train_files": ["train.parquet"], "train_batch_size": 8, "max_prompt_length": 32,
                 "max_response_length": 16},
        "model": {"hf_config": MODEL},
        "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2,
                  "megatron": {"tensor_model_parallel_size": 2}},
        "rollout": {"n": 4},
        "reward_model": {"enable": True, "model_path": str(tmp_path / "rm")},
        "resources": {"actor_pool": {"nnodes": 1, "devices_per_node": 2}},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
    cfg = load_config(tmp_path / "exp.yaml", list(overrides))
    return resolve_run_spec(cfg, "/models/initial", pad_token_id=7, eos_token_ids=[3], total_steps=10)


def test_colocated_reward_model_takes_the_actor_layout(tmp_path: Path) -> None:
    spec = resolve(tmp_path, "reward_model.micro_batch_size_per_gpu=5", "reward_model.param_offload=true",
                   "reward_model.combine=weighted_sum", "reward_model.rule_weight=0.25", "reward_model.model_weight=2")
    rm = spec.reward_model
    assert rm.name == "reward_model" and rm.model_dir == str(tmp_path / "rm") and rm.family is None
    assert rm.engine.role == "reward" and rm.engine.forward_micro_batch_size == 5
    assert rm.layout == ParallelLayout(tp=2) and rm.offload == OffloadSpec(params=True)
    assert rm.update is None and rm.loss is None and not rm.engine.trained  # frozen: no optimizer built
    assert spec.reward_combine == RewardCombine("weighted_sum", 0.25, 2.0)


def test_reward_model_in_its_own_pool_with_its_own_layout(tmp_path: Path) -> None:
    spec = resolve(tmp_path, "resources.reward_model_pool.devices_per_node=1",
                   "reward_model.megatron={tensor_model_parallel_size: 1}")
    assert spec.reward_model.layout == ParallelLayout(tp=1)
    assert spec.reward_combine == RewardCombine()


def test_no_reward_model_by_default(tmp_path: Path) -> None:
    assert resolve(tmp_path, "reward_model.enable=false", "reward_model.model_path=null").reward_model is None
