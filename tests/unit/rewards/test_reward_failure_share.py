"""reward.max_failure_share: a batch in which most scoring calls failed stops the run with an error
that names the function and quotes the first failure; below the share, failures cost samples only."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from megarl.config import load_config
from megarl.config.schema import RewardConfig
from megarl.data.tokenizer import build_char_tokenizer
from megarl.errors import ConfigError
from megarl.protocol.batch import Batch
from megarl.rewards.manager import RewardFailureError, RewardManager
from megarl.trainer.loop import RLTrainer
from megarl.trainer.validation import validate

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

USER_FILE = '''
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.startswith("fail"):
        return 1 / 0
    return 1.0


def early_and_late(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "late":
        time.sleep(1.0)
        raise ValueError("late failure")
    raise KeyError("early failure")


def sleeps(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(30)


def exits(data_source, solution_str, ground_truth, extra_info=None):
    import os

    os._exit(1)
'''


@pytest.fixture
def user_file(tmp_path: Path) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return str(path)


def score(manager: RewardManager, texts: list[str]):
    mask = torch.ones(len(texts), 1, dtype=torch.int64)
    return manager.score(texts, ["1"] * len(texts), ["task"] * len(texts), None, None, mask)


def test_share_above_the_limit_raises_naming_function_first_failure_and_counts(user_file: str) -> None:
    with RewardManager(custom_fn_path=user_file, num_workers=2, timeout_s=5.0) as manager:
        # 2 of 4 failed: 0.5 is not above the default 0.5; those samples score 0.
        result = score(manager, ["fail", "ok", "fail", "ok"])
        assert result.scores.tolist() == [0.0, 1.0, 0.0, 1.0] and result.metrics["reward/num_failed"] == 2
        with pytest.raises(RewardFailureError) as error:
            score(manager, ["fail a", "ok", "fail b", "fail c"])
    text = str(error.value)
    assert f"reward function 'compute_score' from '{user_file}'" in text
    assert "failed on 3 of 4 calls" in text and "reward.max_failure_share = 0.5" in text
    assert "error 3, bad_return 0, timeout 0, crash 0" in text
    # The failure quoted: exception type, message, and the last traceback line (file, line, source).
    assert "ZeroDivisionError: division by zero at my_reward.py:7: `return 1 / 0`" in text


def test_the_first_failure_is_the_first_in_time_not_in_order(user_file: str) -> None:
    with RewardManager(custom_fn_path=user_file, custom_fn_name="early_and_late", num_workers=2) as manager:
        with pytest.raises(RewardFailureError) as error:
            score(manager, ["late", "early"])  # one call per worker: "early" fails 1 s before "late"
    assert "(sample 1, data_source 'task'): error: KeyError: 'early failure'" in str(error.value)


def test_share_of_one_turns_the_rule_off_and_bad_values_are_refused(user_file: str) -> None:
    with RewardManager(custom_fn_path=user_file, num_workers=1, max_failure_share=1.0) as manager:
        result = score(manager, ["fail"] * 3)
    assert result.scores.tolist() == [0.0] * 3 and result.metrics["reward/num_error"] == 3
    with pytest.raises(ConfigError, match=r"reward.max_failure_share = 1.5: must be in \[0, 1\]"):
        RewardManager(max_failure_share=1.5)
    with pytest.raises(ConfigError, match="reward.batch_timeout_s = 0"):
        RewardManager(batch_timeout_s=0)


def test_a_lost_batch_stops_early_instead_of_restarting_a_worker_per_call(user_file: str) -> None:
    with RewardManager(custom_fn_path=user_file, custom_fn_name="exits", num_workers=2) as manager:
        with pytest.raises(RewardFailureError) as error:
            score(manager, ["x"] * 10)
        restarts = manager._pool.restarts
    text = str(error.value)
    # More than 5 of 10 crashed: the batch is lost whatever the rest return, so the rest never run.
    crashed = int(text.split("crash ")[1].split(";")[0])
    assert 5 < crashed < 10 and f"{10 - crashed} calls not run once the batch was lost" in text
    assert "crash: worker exited with code 1 during the call" in text
    assert restarts <= crashed + 2  # one per crash, plus the workers stopped mid-call


def test_batch_deadline_from_config_turns_a_hang_into_a_stop(user_file: str) -> None:
    config = RewardConfig()
    config.custom_reward_function.path = user_file
    config.custom_reward_function.name = "sleeps"
    config.num_workers = 2
    config.batch_timeout_s = 1.0
    config.worker_memory_mb = 256
    config.max_failure_share = 0.5
    with RewardManager.from_config(config, max_response_length=4) as manager:
        assert manager._pool is not None and manager._pool.memory_mb == 256
        start = time.monotonic()
        with pytest.raises(RewardFailureError) as error:
            score(manager, ["x"] * 8)
        elapsed = time.monotonic() - start
    text = str(error.value)
    assert "failed on 8 of 8 calls" in text and "timeout 8, crash 0" in text
    assert "ran past its deadline of 1 s (reward.batch_timeout_s)" in text
    assert elapsed < 10  # 8 calls of 30 s, or 8 per-call timeouts of 10 s, would take minutes


def test_the_trainers_scoring_call_raises_in_training_and_in_validation(user_file: str, tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer("0123456789failok", tmp_path / "tokenizer")
    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "failok"}
    rows = [[ids[c] for c in "fail"], [ids[c] for c in "fail"], [ids[c] for c in "ok"] + [0, 0]]
    gen = Batch.from_dict(
        {"responses": torch.tensor(rows), "response_mask": torch.tensor([[1] * 4, [1] * 4, [1, 1, 0, 0]])},
        non_tensors={"ground_truth": ["1"] * 3, "data_source": ["task"] * 3, "uid": ["a", "b", "c"]},
    )
    with RewardManager(custom_fn_path=user_file, num_workers=1) as manager:
        # The driver loop's own method, with the state it reads: the run's manager and tokenizer,
        # and no reward-model workers.
        trainer = SimpleNamespace(run=SimpleNamespace(reward_manager=manager, tokenizer=tokenizer),
                                  workers=SimpleNamespace(reward_model=None))
        with pytest.raises(RewardFailureError, match="failed on 2 of 3 calls"):
            RLTrainer.score(trainer, gen)
        with pytest.raises(RewardFailureError, match="failed on 2 of 3 calls"):
            validate([gen], lambda prompts, first: prompts, lambda g: RLTrainer.score(trainer, g)[0], n=1)
        scored, metrics = RLTrainer.score(trainer, gen[[2]])
    assert metrics["reward/num_failed"] == 0 and scored["token_level_scores"].tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_config_validation_names_the_new_keys(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({
        "data": {"train_files": ["train.parquet"], "max_prompt_length": 32, "max_response_length": 16},
        "model": {"hf_config": {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
                                "vocab_size": 64, "max_position_embeddings": 128}},
        "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2},
        "rollout": {"n": 4},
    }))
    cfg = load_config(path, ["reward.batch_timeout_s=null", "reward.worker_memory_mb=0", "reward.max_failure_share=1.0",
                             "reward.custom_reward_function.path=reward.py"])
    assert cfg.reward.batch_timeout_s is None and cfg.reward.max_failure_share == 1.0
    with pytest.raises(ConfigError) as error:
        load_config(path, ["reward.max_failure_share=1.5", "reward.batch_timeout_s=0", "reward.worker_memory_mb=-1"])
    text = str(error.value)
    assert "reward.max_failure_share = 1.5: must be in [0.0, 1.0]" in text
    assert "reward.batch_timeout_s = 0.0: must be > 0" in text and "reward.worker_memory_mb = -1: must be >= 0" in text
