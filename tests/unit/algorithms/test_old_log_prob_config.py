"""The keys of the on-policy shortcut and the rollout correction: validated with errors that name the
key and what would be valid, resolved into the actor's loss spec (auto decided by the on-policy rule)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from megarl.algorithms import CORRECTION_LEVELS, CORRECTION_MODES, RolloutCorrectionSettings
from megarl.config import load_config
from megarl.config import rollout_rules
from megarl.errors import ConfigError
from megarl.trainer.run_spec import resolve_run_spec
from megarl.workers.losses import OLD_LOG_PROB_SOURCES

pytestmark = pytest.mark.unit

MODEL = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 4, "intermediate_size": 128, "vocab_size": 64, "max_position_embeddings": 128}
# One mini-batch of the whole batch (8 prompts), one epoch: on-policy.
BASE = {
    "data": {"train_files": ["train.parquet"], "train_batch_size": 8, "max_prompt_length": 32, "max_response_length": 16},
    "model": {"hf_config": MODEL},
    "actor": {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4, "megatron": {"tensor_model_parallel_size": 2}},
    "rollout": {"n": 4},
    "resources": {"actor_pool": {"nnodes": 1, "devices_per_node": 2}},
}


def config(tmp_path: Path, *overrides: str):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(BASE))
    return load_config(path, list(overrides))


def resolve(tmp_path: Path, *overrides: str):
    return resolve_run_spec(config(tmp_path, *overrides), "/models/initial", pad_token_id=7, eos_token_ids=[3],
                            total_steps=10)


def errors(tmp_path: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        config(tmp_path, *overrides)
    return str(info.value)


def test_torch_free_copies_of_the_names_match_the_modules() -> None:
    assert rollout_rules.OLD_LOG_PROB_SOURCES == ("auto", *OLD_LOG_PROB_SOURCES)
    assert rollout_rules.CORRECTION_MODES == CORRECTION_MODES and rollout_rules.CORRECTION_LEVELS == CORRECTION_LEVELS


@pytest.mark.parametrize(("overrides", "source"), [
    ((), "update"),  # on-policy, nothing needs the old log-probs before the update
    (("actor.ppo_epochs=2",), "recompute"),
    (("actor.ppo_mini_batch_size=4",), "recompute"),  # two mini-batches: the second is off-policy
    (("algorithm.use_kl_in_reward=true",), "recompute"),  # the KL in the reward needs them first
    (("actor.old_log_prob_source=recompute",), "recompute"),
    (("actor.old_log_prob_source=rollout", "actor.ppo_epochs=2"), "rollout"),
    (("actor.old_log_prob_source=update",), "update"),
])
def test_auto_takes_the_shortcut_only_on_policy(tmp_path: Path, overrides: tuple[str, ...], source: str) -> None:
    assert resolve(tmp_path, *overrides).actor.loss.old_log_prob_source == source


def test_correction_keys_and_gap_threshold_reach_the_specs(tmp_path: Path) -> None:
    spec = resolve(tmp_path, "algorithm.rollout_correction.mode=mis", "algorithm.rollout_correction.level=geometric",
                   "algorithm.rollout_correction.lower=0.8", "algorithm.rollout_correction.upper=1.25",
                   "rollout.max_logprob_gap=0.02")
    assert spec.actor.loss.rollout_correction == RolloutCorrectionSettings(
        mode="mis", level="geometric", lower=0.8, upper=1.25)
    assert spec.max_logprob_gap == 0.02
    spec = resolve(tmp_path, "algorithm.rollout_correction.mode=tis", "algorithm.rollout_correction.threshold=3.0")
    assert spec.actor.loss.rollout_correction == RolloutCorrectionSettings(mode="tis", threshold=3.0)
    default = resolve(tmp_path)
    assert default.actor.loss.rollout_correction == RolloutCorrectionSettings() and default.max_logprob_gap == 0.1
    assert resolve(tmp_path, "rollout.max_logprob_gap=null").max_logprob_gap is None


@pytest.mark.parametrize(("overrides", "message"), [
    (("actor.old_log_prob_source=always",), r"actor.old_log_prob_source = 'always': must be one of \['auto', "),
    (("actor.old_log_prob_source=update", "actor.ppo_epochs=2"),
     r"'update' needs an on-policy update .* ppo_epochs = 2"),
    (("actor.old_log_prob_source=update", "actor.ppo_mini_batch_size=4"),
     r"'update' needs an on-policy update .* ppo_mini_batch_size = 4, train_batch_size = 8"),
    (("actor.old_log_prob_source=update", "algorithm.use_kl_in_reward=true"), "KL in the reward needs"),
    (("actor.old_log_prob_source=rollout", "rollout.calculate_log_probs=false"),
     "'rollout' needs the rollout engine's log-probs: set rollout.calculate_log_probs: true"),
    (("algorithm.rollout_correction.mode=tis", "rollout.calculate_log_probs=false"),
     "mode = 'tis' needs the rollout engine's log-probs"),
    (("algorithm.rollout_correction.mode=clip",), r"rollout_correction.mode = 'clip': must be one of"),
    (("algorithm.rollout_correction.level=seq",), r"rollout_correction.level = 'seq': must be one of"),
    (("algorithm.rollout_correction.mode=icepop", "algorithm.rollout_correction.level=sequence"),
     "icepop weighs single tokens; use level token"),
    (("algorithm.rollout_correction.mode=tis", "actor.old_log_prob_source=rollout"), "would apply it twice"),
    (("algorithm.rollout_correction.mode=icepop", "actor.old_log_prob_source=rollout"), "would apply it twice"),
    (("algorithm.rollout_correction.threshold=0",), r"rollout_correction.threshold = 0.*> 0"),
    (("algorithm.rollout_correction.lower=1.5", "algorithm.rollout_correction.upper=1.2"),
     r"upper = 1.2: must be >= lower = 1.5"),
    (("rollout.max_logprob_gap=-1",), r"rollout.max_logprob_gap = -1"),
])
def test_bad_combinations_are_refused_by_name(tmp_path: Path, overrides: tuple[str, ...], message: str) -> None:
    assert re.search(message, errors(tmp_path, *overrides)), errors(tmp_path, *overrides)


def test_allowed_combinations_validate(tmp_path: Path) -> None:
    config(tmp_path, "algorithm.rollout_correction.mode=reject", "actor.old_log_prob_source=rollout")
    config(tmp_path, "algorithm.rollout_correction.mode=icepop", "actor.old_log_prob_source=recompute")
    config(tmp_path, "algorithm.rollout_correction.mode=tis", "actor.old_log_prob_source=rollout",
           "actor.policy_loss.loss_mode=reinforce")
    config(tmp_path, "algorithm.rollout_correction.mode=mis", "algorithm.rollout_correction.level=sequence",
           "actor.ppo_epochs=2")


@pytest.mark.parametrize(("overrides", "skips"), [
    ((), True),  # vanilla PPO loss, no entropy bonus, no KL loss: zero-advantage rows add nothing
    (("actor.policy_loss.loss_mode=cispo", "actor.ppo_epochs=2"), True),
    (("actor.skip_zero_advantage_rows=false",), False),
    (("actor.entropy_coeff=0.001",), False),
    (("actor.use_kl_loss=true",), False),
])
def test_zero_advantage_rows_are_skipped_only_where_they_add_nothing(tmp_path: Path, overrides: tuple[str, ...],
                                                                     skips: bool) -> None:
    assert resolve(tmp_path, *overrides).actor.loss.skip_zero_advantage_rows is skips
