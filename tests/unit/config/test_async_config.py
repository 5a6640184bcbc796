"""`trainer.async_mode` and `resources.rollout_pool`: what the separate rollout placement and the
one-step-off mode need is checked before any worker starts, with the key and what would be valid."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megarl.config import load_config
from megarl.data.tokenizer import build_char_tokenizer
from megarl.errors import ConfigError

pytestmark = pytest.mark.unit

HF = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def _experiment(tmp_path: Path, trainer: dict, resources: dict, rollout: dict | None = None,
                algorithm: dict | None = None) -> Path:
    build_char_tokenizer("0123456789+=", tmp_path / "tok")
    exp = {
        "data": {"train_files": ["train.parquet"], "tokenizer": str(tmp_path / "tok"), "train_batch_size": 4,
                 "max_prompt_length": 16, "max_response_length": 8},
        "model": {"hf_config": HF},
        "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2},
        "rollout": {"n": 2, **(rollout or {})},
        "algorithm": algorithm or {},
        "trainer": trainer,
        "resources": {"actor_pool": {"nnodes": 1, "devices_per_node": 2}, **resources},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def _errors(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


POOL2 = {"rollout_pool": {"nnodes": 1, "devices_per_node": 2}}


def test_one_step_off_with_its_own_rollout_pool_validates(tmp_path: Path) -> None:
    cfg = load_config(_experiment(tmp_path, {"async_mode": "one_step_off"}, POOL2,
                                  {"free_cache_engine": False}))
    assert cfg.trainer.async_mode == "one_step_off" and cfg.resources.rollout_pool.devices_per_node == 2


def test_one_step_off_without_a_rollout_pool_is_refused(tmp_path: Path) -> None:
    message = _errors(_experiment(tmp_path, {"async_mode": "one_step_off"}, {}))
    assert "trainer.async_mode = 'one_step_off' needs resources.rollout_pool" in message


def test_unknown_mode_names_the_valid_ones_and_what_is_not_built(tmp_path: Path) -> None:
    message = _errors(_experiment(tmp_path, {"async_mode": "fully_async"}, {}))
    assert "trainer.async_mode = 'fully_async': valid: sync, one_step_off, bounded_staleness" in message
    assert "bounded_staleness with trainer.partial_rollout" in message and "not built" in message


def test_rollout_pool_of_another_size_is_refused(tmp_path: Path) -> None:
    message = _errors(_experiment(tmp_path, {}, {"rollout_pool": {"nnodes": 1, "devices_per_node": 1}},
                                  {"free_cache_engine": False}))
    assert "resources.rollout_pool: 1 ranks" in message and "resources.actor_pool (2)" in message


def test_sleeping_engine_in_its_own_pool_is_refused(tmp_path: Path) -> None:
    message = _errors(_experiment(tmp_path, {}, POOL2))
    assert "rollout.free_cache_engine: true with resources.rollout_pool" in message


def test_one_step_off_refuses_dynamic_sampling_and_missing_rollout_log_probs(tmp_path: Path) -> None:
    message = _errors(_experiment(tmp_path, {"async_mode": "one_step_off"}, POOL2,
                                  {"free_cache_engine": False, "calculate_log_probs": False},
                                  {"filter_groups": {"enable": True}}))
    assert "with algorithm.filter_groups.enable" in message
    assert "needs rollout.calculate_log_probs: true" in message


def test_max_staleness_is_checked_and_belongs_to_bounded_staleness(tmp_path: Path) -> None:
    assert "trainer.max_staleness = 0: must be >= 1" in _errors(_experiment(tmp_path, {"max_staleness": 0}, {}))
    message = _errors(_experiment(tmp_path, {"async_mode": "one_step_off", "max_staleness": 3}, POOL2,
                                  {"free_cache_engine": False}))
    assert "trainer.max_staleness = 3 is used only by trainer.async_mode bounded_staleness" in message
    cfg = load_config(_experiment(tmp_path, {"async_mode": "bounded_staleness", "max_staleness": 3}, POOL2,
                                  {"free_cache_engine": False}))
    assert cfg.trainer.max_staleness == 3


def test_partial_rollout_keys_are_checked(tmp_path: Path) -> None:
    pipelined = {"async_mode": "one_step_off"}
    rollout = {"free_cache_engine": False}
    message = _errors(_experiment(tmp_path, {**pipelined, "partial_rollout": "resume"}, POOL2, rollout))
    assert "trainer.partial_rollout = 'resume': valid: off, continue, drop" in message
    message = _errors(_experiment(tmp_path, {**pipelined, "partial_rollout": "continue",
                                             "partial_rollout_chunk_tokens": 0,
                                             "partial_rollout_interrupt_after": 0}, POOL2, rollout))
    assert "trainer.partial_rollout_chunk_tokens = 0: must be >= 1" in message
    assert "trainer.partial_rollout_interrupt_after = 0: must be >= 1 chunk" in message
    message = _errors(_experiment(tmp_path, {"partial_rollout_chunk_tokens": 4}, {}))
    assert "trainer.partial_rollout_chunk_tokens = 4 with trainer.partial_rollout = 'off'" in message
    message = _errors(_experiment(tmp_path, {"partial_rollout": "drop"}, {}))
    assert "trainer.partial_rollout = 'drop' with trainer.async_mode = 'sync'" in message
    message = _errors(_experiment(tmp_path, {**pipelined, "partial_rollout": "continue"}, POOL2,
                                  {**rollout, "multi_turn": {"enable": True, "tools": ["calculator"]}}))
    assert "with rollout.multi_turn.enable" in message
    cfg = load_config(_experiment(tmp_path, {"async_mode": "bounded_staleness", "max_staleness": 2,
                                             "partial_rollout": "continue", "partial_rollout_chunk_tokens": 4,
                                             "partial_rollout_interrupt_after": 1}, POOL2, rollout))
    assert (cfg.trainer.partial_rollout, cfg.trainer.partial_rollout_chunk_tokens,
            cfg.trainer.partial_rollout_interrupt_after) == ("continue", 4, 1)
