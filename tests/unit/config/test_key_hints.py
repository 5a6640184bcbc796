"""Keys verl users bring get a hint that names the megarl key doing the same thing, never a key that
merely looks alike (`reward_model.overlong_buffer.enable` must not point at `reward_model.enable`,
which would start a reward model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_config import VALID, errors_of, write

from megarl.config import all_keys, load_config
from megarl.config import loader

pytestmark = pytest.mark.unit


@pytest.fixture
def valid_file(tmp_path: Path) -> Path:
    return write(tmp_path, "exp.yaml", VALID)


# (override, what the error must name, what it must not name)
VERL_KEYS = [
    ("reward_model.overlong_buffer.enable=true", "did you mean 'reward.overlong_buffer.enable'?", "reward_model.enable"),
    ("reward_model.overlong_buffer.len=512", "did you mean 'reward.overlong_buffer.len'?", "reward_model.enable"),
    ("trainer.logger=[console,wandb]", "did you mean 'tracking.backends'?", "trainer.seed"),
    ("rollout.name=vllm", "did you mean 'rollout.engine'?", "'rollout.n'"),
    ("rollout.log_prob_micro_batch_size_per_gpu=8", "did you mean 'actor.log_prob_micro_batch_size_per_gpu'?",
     "rollout.logprobs_mode"),
    ("actor_rollout_ref.actor.optim.lr=1e-6", "did you mean 'actor.optim.lr'?", "kl_loss_coef"),
    ("actor_rollout_ref.rollout.n=8", "did you mean 'rollout.n'?", "kl_loss_coef"),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
     "did you mean 'actor.log_prob_micro_batch_size_per_gpu'?", "logprobs_mode"),
    ("actor_rollout_ref.actor.use_remove_padding=true", "'actor.use_remove_padding' is not a megarl key: use "
     "model.use_remove_padding", "kl_loss_coef"),
    ("actor.ulysses_sequence_parallel_size=2", "did you mean 'actor.megatron.context_parallel_size'?",
     "actor.megatron.sequence_parallel'"),
    ("actor_rollout_ref.ref.ulysses_sequence_parallel_size=2", "did you mean 'ref.megatron.context_parallel_size'?",
     "sequence_parallel'"),
    ("data.return_raw_chat=true", "'data.return_raw_chat' is not a megarl key: megarl always keeps each row's "
     "prompt messages", "data.truncation"),
    ("reward_model.reward_manager=dapo", "'reward_model.reward_manager' is not a megarl key: megarl has one reward "
     "manager. verl's naive is the default; its dapo is reward.overlong_buffer.enable", "did you mean"),
    ("custom_reward_function.path=reward.py", "did you mean 'reward.custom_reward_function.path'?", "model.path"),
]


@pytest.mark.parametrize(("override", "right", "wrong"), VERL_KEYS, ids=[case[0].split("=")[0] for case in VERL_KEYS])
def test_a_verl_key_is_pointed_at_the_megarl_key(valid_file: Path, override: str, right: str, wrong: str) -> None:
    msg = errors_of(valid_file, override)
    assert f"command-line override '{override}'" in msg
    assert right in msg
    assert wrong not in msg
    assert "reward_model.enable" not in msg  # a hint must never switch a reward model on


def test_a_verl_section_in_a_file_is_pointed_at_megarl_sections(tmp_path: Path) -> None:
    exp = {**VALID, "reward_model": {"overlong_buffer": {"enable": True, "len": 4, "penalty_factor": 1.0}},
           "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}, "rollout": {"n": 4}}}
    msg = errors_of(write(tmp_path, "verl.yaml", exp))
    assert "unknown key 'reward_model.overlong_buffer'; did you mean 'reward.overlong_buffer'?" in msg
    assert ("unknown key 'actor_rollout_ref': verl's actor_rollout_ref.actor, .rollout, .ref and .model are "
            "megarl's top-level sections actor, rollout, ref and model; drop the prefix") in msg
    # One key under the prefix: the hint is that key.
    exp = {**VALID, "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}}}
    assert "did you mean 'actor.optim.lr'?" in errors_of(write(tmp_path, "one.yaml", exp))


def test_the_megarl_keys_named_in_hints_exist(valid_file: Path) -> None:
    known = set(all_keys())
    for verl_key, megarl_key in loader.RENAMED_KEYS.items():
        assert megarl_key in known, f"RENAMED_KEYS[{verl_key!r}] = {megarl_key!r}: not a megarl key"
        assert verl_key not in known, f"{verl_key!r} is a megarl key: nothing to rename"
    for verl_key, advice in loader.REMOVED_KEYS.items():
        assert verl_key not in known
        for named in re.findall(r"\b[a-z_]+(?:\.[a-z_]+)+\b", advice):
            assert named in known, f"REMOVED_KEYS[{verl_key!r}] names {named!r}, not a megarl key"
    # The named keys take what verl's key did.
    cfg = load_config(valid_file, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4",
                                   "tracking.backends=[console]", "rollout.engine=hf",
                                   "actor.log_prob_micro_batch_size_per_gpu=2"])
    assert cfg.reward.overlong_buffer.enable and not cfg.reward_model.enable
    assert loader.megarl_spelling("actor_rollout_ref.rollout.name") == "rollout.engine"
    assert loader.megarl_spelling("rollout.temperature") == "rollout.temperature"


def test_typos_still_get_the_nearest_key(valid_file: Path) -> None:
    assert "did you mean 'rollout.temperature'?" in errors_of(valid_file, "rollout.temprature=0.7")
    assert "did you mean 'actor.optim.lr'?" in errors_of(valid_file, "actor.lr=1e-6")
    assert "did you mean 'reward_model.model_path'?" in errors_of(valid_file, "reward_model.modle_path=x")
