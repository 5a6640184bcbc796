"""Validation rules that refuse, before any worker starts, values that used to fail inside the workers
or be ignored: the critic's own model, optimizer ranges, the DAPO filter metric, scorer options, and
keys that this config never reads."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from megarl.algorithms.dapo import TENSOR_METRICS
from megarl.config import algorithm_rules, load_config
from megarl.rewards.scorers import SCORERS
from megarl.trainer.checkpoint_dirs import CheckpointDirs
from test_config import TINY_MODEL, VALID, errors_of, write

pytestmark = pytest.mark.unit


def experiment(tmp_path: Path, **sections: dict) -> Path:
    """VALID with `sections` merged over it (one level deep per section)."""
    data = copy.deepcopy(VALID)
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return write(tmp_path, "exp.yaml", data)


def model_dir(path: Path, **config: object) -> Path:
    """A HF directory holding only config.json (the rules read no weights)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**TINY_MODEL, **config}))
    return path


@pytest.fixture
def valid_file(tmp_path: Path) -> Path:
    return experiment(tmp_path)


def test_critic_layout_is_checked_against_its_own_model(tmp_path: Path, valid_file: Path) -> None:
    # The actor (4 heads) runs at TP=2; the critic shares that layout but starts from a 3-head model.
    critic = model_dir(tmp_path / "critic", num_attention_heads=3, num_key_value_heads=3)
    msg = errors_of(valid_file, "algorithm.adv_estimator=gae", f"critic.model_path={critic}")
    assert ("critic.megatron.tensor_model_parallel_size = 2: must divide the model's num_attention_heads = 3; "
            "valid: 1, 3") in msg
    assert "actor.megatron" not in msg
    fits = model_dir(tmp_path / "fits", num_attention_heads=2, num_key_value_heads=2)
    assert load_config(valid_file, ["algorithm.adv_estimator=gae", f"critic.model_path={fits}"]).critic.model_path
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    msg = errors_of(valid_file, "algorithm.adv_estimator=gae", f"critic.model_path={bad_json}")
    assert f"critic.model_path: {bad_json / 'config.json'} is not valid JSON" in msg


def test_adaptive_kl_controller_needs_a_positive_target(valid_file: Path) -> None:
    adaptive = ("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive")
    msg = errors_of(valid_file, *adaptive, "algorithm.kl_ctrl.target_kl=0")
    assert "algorithm.kl_ctrl.target_kl = 0.0 with algorithm.kl_ctrl.type = 'adaptive': must be > 0" in msg
    assert load_config(valid_file, [*adaptive, "algorithm.kl_ctrl.target_kl=0.05"]).algorithm.kl_ctrl.target_kl == 0.05


def test_filter_metric_must_be_one_the_scoring_computes(tmp_path: Path, valid_file: Path) -> None:
    dapo = "algorithm.filter_groups.enable=true"
    msg = errors_of(valid_file, dapo, "algorithm.filter_groups.metric=accuracy")
    assert ("algorithm.filter_groups.metric = 'accuracy': the built-in scorers do not compute it; valid: "
            "['seq_reward', 'seq_final_reward', 'score', 'acc', 'format', 'failed']") in msg
    for metric in ("acc", "score", "format", "failed", "seq_reward", "seq_final_reward"):
        cfg = load_config(valid_file, [dapo, f"algorithm.filter_groups.metric={metric}"])
        assert cfg.algorithm.filter_groups.metric == metric
    # Keys only some runs report: overlong shaping's penalty, the tools' reward.
    overlong = "algorithm.filter_groups.metric=overlong_penalty"
    assert "'overlong_penalty': the built-in scorers do not compute it" in errors_of(valid_file, dapo, overlong)
    load_config(valid_file, [dapo, overlong, "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4"])
    tools = "algorithm.filter_groups.metric=tool_reward"
    assert "'tool_reward': the built-in scorers do not compute it" in errors_of(valid_file, dapo, tools)
    # A custom function may return any key.
    load_config(valid_file, [dapo, "algorithm.filter_groups.metric=my_key",
                             f"reward.custom_reward_function.path={tmp_path / 'reward.py'}"])


def test_filter_metric_with_a_reward_model_is_its_score(tmp_path: Path, valid_file: Path) -> None:
    rm = model_dir(tmp_path / "rm")
    with_rm = ("algorithm.filter_groups.enable=true", "reward_model.enable=true", f"reward_model.model_path={rm}")
    for metric in ("acc", "score"):
        msg = errors_of(valid_file, *with_rm, f"algorithm.filter_groups.metric={metric}")
        assert (f"algorithm.filter_groups.metric = '{metric}' with reward_model.enable: a row the reward model scores "
                "alone (reward_model.style 'model') carries 0 in the rule scorer's keys") in msg
        assert "use seq_reward" in msg
    for metric in ("seq_reward", "rm_score"):
        assert load_config(valid_file, [*with_rm, f"algorithm.filter_groups.metric={metric}"]).reward_model.enable


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_optimizer_keys_are_in_range(valid_file: Path, role: str) -> None:
    on = ["critic.enable=true"] if role == "critic" else []
    key = f"{role}.optim"
    msg = errors_of(valid_file, *on, f"{key}.lr_warmup_steps=-1")
    assert (f"{key}.lr_warmup_steps = -1: verl's 'use lr_warmup_steps_ratio' is 0 in megarl (0: warm up over "
            "lr_warmup_steps_ratio x the schedule's steps); set 0") in msg
    assert f"{key}.lr_warmup_steps = -3: must be >= 0" in errors_of(valid_file, *on, f"{key}.lr_warmup_steps=-3")
    msg = errors_of(valid_file, *on, f"{key}.lr_warmup_steps_ratio=1.0", f"{key}.eps=0", f"{key}.lr=1e-6",
                    f"{key}.min_lr=1e-5")
    assert f"{key}.lr_warmup_steps_ratio = 1.0: must be in [0, 1)" in msg
    assert f"{key}.eps = 0.0: must be > 0" in msg
    assert f"{key}.min_lr = 1e-05: must be <= {key}.lr = 1e-06" in msg
    for betas in ("[0.9]", "[0.9,1.0]", "[0.9,0.99,0.999]", "[-0.1,0.9]"):
        assert f"{key}.betas = " in errors_of(valid_file, *on, f"{key}.betas={betas}")
    assert "must be a list of 2 numbers in [0, 1)" in errors_of(valid_file, *on, f"{key}.betas=[0.9]")
    assert f"{key}.lr = -0.1: must be >= 0" in errors_of(valid_file, *on, f"{key}.lr=-0.1")
    cfg = load_config(valid_file, [*on, f"{key}.lr=0", f"{key}.lr_warmup_steps=0", f"{key}.lr_warmup_steps_ratio=0.1",
                                   f"{key}.betas=[0.0,0.95]", f"{key}.lr_scheduler=cosine"])
    assert list(cfg[role].optim.betas) == [0.0, 0.95]


def test_rollout_engine_sizes_are_at_least_one(valid_file: Path) -> None:
    msg = errors_of(valid_file, "rollout.max_num_seqs=0", "rollout.update_weights_bucket_mb=0")
    assert "rollout.max_num_seqs = 0: must be >= 1" in msg
    assert "rollout.update_weights_bucket_mb = 0: must be >= 1" in msg
    load_config(valid_file, ["rollout.max_num_seqs=1", "rollout.update_weights_bucket_mb=1"])


def test_scorer_options_are_checked_by_config_validate(tmp_path: Path) -> None:
    bad_mode = experiment(tmp_path, reward={"reward_kwargs": {"arithmetic": {"mode": "bogus"}}})
    assert "reward.reward_kwargs.arithmetic.mode = 'bogus'; valid: " in errors_of(bad_mode)
    unknown = experiment(tmp_path, reward={"reward_kwargs": {"nope": {}}})
    assert "reward.reward_kwargs: 'nope' is not a built-in scorer; known: " in errors_of(unknown)
    bad_option = experiment(tmp_path, reward={"reward_kwargs": {"gsm8k": {"strictness": 1}}})
    assert "reward.reward_kwargs.gsm8k: " in errors_of(bad_option)
    not_a_mapping = experiment(tmp_path, reward={"reward_kwargs": {"arithmetic": 3}})
    assert "reward.reward_kwargs.arithmetic = 3: must be a mapping of the scorer's options" in errors_of(not_a_mapping)
    # With a custom function the keyword arguments are the function's own.
    custom = experiment(tmp_path, reward={"reward_kwargs": {"nope": {}},
                                          "custom_reward_function": {"path": str(tmp_path / "reward.py")}})
    assert load_config(custom).reward.reward_kwargs.nope == {}
    good = experiment(tmp_path, reward={"reward_kwargs": {"arithmetic": {"mode": "startswith"}}})
    assert load_config(good).reward.reward_kwargs.arithmetic.mode == "startswith"


def test_max_ckpt_to_keep_null_keeps_every_checkpoint(tmp_path: Path, valid_file: Path) -> None:
    assert load_config(valid_file, ["trainer.max_ckpt_to_keep=null"]).trainer.max_ckpt_to_keep is None
    in_yaml = experiment(tmp_path, trainer={"max_ckpt_to_keep": None})
    keep = load_config(in_yaml).trainer.max_ckpt_to_keep
    assert keep is None
    assert CheckpointDirs(tmp_path / "checkpoints", keep).max_to_keep is None  # what the trainer passes it
    assert ("trainer.max_ckpt_to_keep = 0: must be >= 1 (the checkpoints saved last that are kept), or null to keep "
            "every checkpoint") in errors_of(valid_file, "trainer.max_ckpt_to_keep=0")
    assert load_config(valid_file, ["trainer.max_ckpt_to_keep=1"]).trainer.max_ckpt_to_keep == 1


def test_kl_loss_keys_need_the_kl_loss(valid_file: Path) -> None:
    msg = errors_of(valid_file, "actor.kl_loss_coef=0.01", "actor.kl_loss_type=k3")
    assert ("actor.kl_loss_coef = 0.01, actor.kl_loss_type = 'k3' without actor.use_kl_loss: only the KL loss reads "
            "them") in msg
    load_config(valid_file, ["actor.kl_loss_coef=0.01", "actor.kl_loss_type=k3", "actor.use_kl_loss=true"])
    load_config(valid_file, ["actor.kl_loss_coef=0.001"])  # the default value: not a setting


def test_dual_clip_bound_needs_the_vanilla_loss(valid_file: Path) -> None:
    msg = errors_of(valid_file, "actor.clip_ratio_c=10", "actor.policy_loss.loss_mode=gspo")
    assert ("actor.clip_ratio_c = 10.0 with actor.policy_loss.loss_mode = 'gspo': only the dual-clip PPO loss "
            "(vanilla) reads it; remove it or set loss_mode vanilla") in msg
    load_config(valid_file, ["actor.clip_ratio_c=10"])  # vanilla
    load_config(valid_file, ["actor.policy_loss.loss_mode=gspo"])


def test_estimator_settings_need_an_estimator_that_reads_them(valid_file: Path) -> None:
    # GRPO (the default) neither discounts nor bootstraps: gamma and lam would change nothing.
    msg = errors_of(valid_file, "algorithm.gamma=0.9", "algorithm.lam=0.95")
    assert ("algorithm.gamma = 0.9, algorithm.lam = 0.95 with algorithm.adv_estimator = 'grpo': that estimator does "
            "not read them (read by gamma: gae, reinforce_plus_plus; lam: gae)") in msg
    msg = errors_of(valid_file, "algorithm.adv_estimator=rloo", "algorithm.norm_adv_by_std_in_grpo=false")
    assert ("algorithm.norm_adv_by_std_in_grpo = False with algorithm.adv_estimator = 'rloo': that estimator does not "
            "read them (read by norm_adv_by_std_in_grpo: grpo, grpo_passk)") in msg
    assert "algorithm.gamma" in errors_of(valid_file, "algorithm.adv_estimator=remax", "algorithm.gamma=0.99")
    load_config(valid_file, ["algorithm.adv_estimator=gae", "algorithm.gamma=0.99", "algorithm.lam=0.95"])
    load_config(valid_file, ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.99"])
    load_config(valid_file, ["algorithm.norm_adv_by_std_in_grpo=false"])  # Dr.GRPO
    load_config(valid_file, ["algorithm.gamma=1.0", "algorithm.lam=1.0"])  # the defaults: not a setting


def test_clipping_keys_need_a_loss_that_clips(valid_file: Path) -> None:
    msg = errors_of(valid_file, "actor.policy_loss.loss_mode=gpg", "actor.clip_ratio_high=0.28")
    assert ("actor.clip_ratio_high = 0.28 with actor.policy_loss.loss_mode = 'gpg': that loss takes no ratio to "
            "clip; remove them or set a clipping loss (cispo, gspo, vanilla)") in msg
    msg = errors_of(valid_file, "actor.policy_loss.loss_mode=reinforce", "actor.clip_ratio=0.3", "actor.clip_ratio_c=10")
    assert "actor.clip_ratio = 0.3, actor.clip_ratio_c = 10.0 with actor.policy_loss.loss_mode = 'reinforce'" in msg
    load_config(valid_file, ["actor.policy_loss.loss_mode=cispo", "actor.clip_ratio_high=0.28"])
    load_config(valid_file, ["actor.policy_loss.loss_mode=gpg"])


def test_correction_keys_need_the_mode_that_reads_them(valid_file: Path) -> None:
    logprobs = "rollout.calculate_log_probs=true"
    msg = errors_of(valid_file, logprobs, "algorithm.rollout_correction.mode=mis",
                    "algorithm.rollout_correction.threshold=5")
    assert ("algorithm.rollout_correction.threshold = 5.0 with algorithm.rollout_correction.mode = 'mis': that mode "
            "does not read them") in msg
    msg = errors_of(valid_file, logprobs, "algorithm.rollout_correction.mode=tis", "algorithm.rollout_correction.upper=5")
    assert "algorithm.rollout_correction.upper = 5.0 with algorithm.rollout_correction.mode = 'tis'" in msg
    msg = errors_of(valid_file, "algorithm.rollout_correction.level=sequence")
    assert "algorithm.rollout_correction.level = 'sequence' with algorithm.rollout_correction.mode = 'none'" in msg
    load_config(valid_file, [logprobs, "algorithm.rollout_correction.mode=tis", "algorithm.rollout_correction.threshold=5"])
    load_config(valid_file, [logprobs, "algorithm.rollout_correction.mode=mis", "algorithm.rollout_correction.level=sequence",
                             "algorithm.rollout_correction.lower=0.8", "algorithm.rollout_correction.upper=1.25"])


def test_critic_keys_need_a_critic(valid_file: Path) -> None:
    msg = errors_of(valid_file, "critic.ppo_epochs=2", "critic.optim.lr=1e-4")
    assert ("critic.optim.lr = 0.0001, critic.ppo_epochs = 2 with no critic (critic.enable = null and "
            "algorithm.adv_estimator = 'grpo'): only a critic reads them; remove them or set critic.enable: "
            "true") in msg
    msg = errors_of(valid_file, "critic.enable=false", "critic.megatron={tensor_model_parallel_size: 2}")
    assert "critic.megatron = " in msg and "with no critic (critic.enable = false)" in msg
    load_config(valid_file, ["critic.enable=false"])  # a critic section of defaults stays valid
    load_config(valid_file, ["critic.ppo_epochs=2", "critic.enable=true"])
    load_config(valid_file, ["critic.ppo_epochs=2", "algorithm.adv_estimator=gae"])


def test_reward_model_keys_need_a_reward_model(tmp_path: Path, valid_file: Path) -> None:
    msg = errors_of(valid_file, "reward_model.micro_batch_size_per_gpu=4", "reward_model.combine=weighted_sum")
    assert ("reward_model.micro_batch_size_per_gpu = 4, reward_model.combine = 'weighted_sum' with "
            "reward_model.enable = false: only a reward model reads them") in msg
    rm = model_dir(tmp_path / "rm")
    on = ("reward_model.enable=true", f"reward_model.model_path={rm}")
    msg = errors_of(valid_file, *on, "reward_model.rule_weight=0.0")
    assert ("reward_model.rule_weight = 0.0 with reward_model.combine = 'by_style': each row takes its rule or its "
            "model score as it is, unweighted; remove them or set combine: weighted_sum") in msg
    cfg = load_config(valid_file, [*on, "reward_model.rule_weight=0.0", "reward_model.combine=weighted_sum"])
    assert cfg.reward_model.rule_weight == 0.0


def test_overlong_keys_need_the_overlong_buffer(valid_file: Path) -> None:
    msg = errors_of(valid_file, "reward.overlong_buffer.len=4", "reward.overlong_buffer.penalty_factor=0.5")
    assert ("reward.overlong_buffer.len = 4, reward.overlong_buffer.penalty_factor = 0.5 without "
            "reward.overlong_buffer.enable: no overlong penalty is computed") in msg
    load_config(valid_file, ["reward.overlong_buffer.len=4", "reward.overlong_buffer.enable=true"])


def test_scoring_pool_keys_need_a_custom_reward_function(tmp_path: Path, valid_file: Path) -> None:
    pool = ("reward.num_workers=4", "reward.timeout_s=5", "reward.batch_timeout_s=null", "reward.worker_memory_mb=0")
    msg = errors_of(valid_file, *pool)
    assert ("reward.num_workers = 4, reward.timeout_s = 5.0, reward.batch_timeout_s = None, "
            "reward.worker_memory_mb = 0 with the built-in scorers only (reward.custom_reward_function.path "
            "unset)") in msg
    load_config(valid_file, [*pool, f"reward.custom_reward_function.path={tmp_path / 'reward.py'}"])
    msg = errors_of(valid_file, "reward.custom_reward_function.name=my_score")
    assert ("reward.custom_reward_function.name = 'my_score' without reward.custom_reward_function.path: the "
            "built-in scorers score the rows") in msg
    load_config(valid_file, ["reward.custom_reward_function.name=my_score",
                             f"reward.custom_reward_function.path={tmp_path / 'reward.py'}"])


def test_filter_metric_names_match_the_code_that_computes_them() -> None:
    # algorithm_rules keeps these without importing torch (dapo) or running a scorer.
    assert set(algorithm_rules.FILTER_SUMS) == set(TENSOR_METRICS)
    truths = {"countdown": {"target": 1, "numbers": [1]}}
    returned = {key for name, scorer in SCORERS.items() for key in scorer("1", truths.get(name, "1"))}
    assert set(algorithm_rules.BUILTIN_REWARD_INFO) == returned | {"failed"}  # failed: the reward manager's


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_schedule_keys_the_schedule_does_not_read(valid_file: Path, role: str) -> None:
    on = ["critic.enable=true"] if role == "critic" else []
    key = f"{role}.optim"
    msg = errors_of(valid_file, *on, f"{key}.lr_warmup_steps=5", f"{key}.lr_warmup_steps_ratio=0.1")
    assert f"{key}.lr_warmup_steps_ratio = 0.1 with {key}.lr_warmup_steps = 5: the steps are used" in msg
    msg = errors_of(valid_file, *on, f"{key}.lr=1e-5", f"{key}.min_lr=1e-6")
    assert f"{key}.min_lr = 1e-06 with {key}.lr_scheduler = 'constant': only a decaying schedule" in msg
    load_config(valid_file, [*on, f"{key}.lr=1e-5", f"{key}.min_lr=1e-6", f"{key}.lr_scheduler=cosine",
                             f"{key}.lr_warmup_steps=5"])


def test_filter_keys_need_the_filter(valid_file: Path) -> None:
    msg = errors_of(valid_file, "algorithm.filter_groups.metric=seq_reward", "algorithm.filter_groups.max_num_gen_batches=3")
    assert ("algorithm.filter_groups.metric = 'seq_reward', algorithm.filter_groups.max_num_gen_batches = 3 without "
            "algorithm.filter_groups.enable: only DAPO's dynamic sampling reads them") in msg
    load_config(valid_file, ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward"])


def test_critic_positions_are_checked_against_its_own_model(tmp_path: Path, valid_file: Path) -> None:
    # The actor's model has 128 positions; a critic started from a 32-position model cannot take prompt 32 +
    # response 16.
    short = model_dir(tmp_path / "short", max_position_embeddings=32)
    msg = errors_of(valid_file, "algorithm.adv_estimator=gae", f"critic.model_path={short}")
    assert (f"data.max_prompt_length + response length = 32 + 16 exceeds the critic's max_position_embeddings = 32 "
            f"(critic.model_path: {short})") in msg
    fits = model_dir(tmp_path / "fits", max_position_embeddings=48)
    assert load_config(valid_file, ["algorithm.adv_estimator=gae", f"critic.model_path={fits}"]).critic.model_path


def test_a_temperature_vllm_would_take_as_greedy_is_refused(valid_file: Path) -> None:
    # vllm.sampling_params: a request below 1e-5 decodes greedily, where the HF engine would sample.
    msg = errors_of(valid_file, "rollout.temperature=1e-6")
    assert "rollout.temperature = 1e-06: below 1e-05 vLLM decodes greedily (and refuses n > 1)" in msg
    msg = errors_of(valid_file, "rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=5e-6")
    assert "rollout.val_kwargs.temperature = 5e-06: below 1e-05" in msg
    load_config(valid_file, ["rollout.temperature=1e-5"])
    # Argmax decoding takes no temperature: refused as unread (test_inert_rollout_keys), not as vLLM's greedy.
    msg = errors_of(valid_file, "rollout.val_kwargs.temperature=1e-6")
    assert "below 1e-05" not in msg and "rollout.val_kwargs.temperature = 1e-06 with rollout.val_kwargs.do_sample" in msg


def test_reference_keys_need_a_reference(valid_file: Path) -> None:
    msg = errors_of(valid_file, "ref.param_offload=true", "ref.log_prob_micro_batch_size_per_gpu=2")
    assert ("ref.log_prob_micro_batch_size_per_gpu = 2, ref.param_offload = True with no reference policy "
            "(ref.enable = None, and no KL term") in msg
    assert load_config(valid_file, ["actor.use_kl_loss=true", "ref.param_offload=true"]).ref.param_offload


def test_reference_micro_batch_with_dynamic_micro_batches(valid_file: Path) -> None:
    # The reference's pass splits by tokens like the actor's (run_spec gives it actor.use_dynamic_bsz).
    msg = errors_of(valid_file, "actor.use_kl_loss=true", "actor.use_dynamic_bsz=true",
                    "ref.log_prob_micro_batch_size_per_gpu=16")
    assert "ref.log_prob_micro_batch_size_per_gpu = 16 with actor.use_dynamic_bsz" in msg
    cfg = load_config(valid_file, ["actor.use_kl_loss=true", "ref.log_prob_micro_batch_size_per_gpu=16"])
    assert cfg.ref.log_prob_micro_batch_size_per_gpu == 16


def test_micro_batches_are_counted_in_sequences_or_in_tokens_not_both(valid_file: Path) -> None:
    # megarl.megatron.engine: use_dynamic_bsz splits by the token budget and reads no sequence count;
    # without it, the count decides and the budget is unread.
    msg = errors_of(valid_file, "actor.use_dynamic_bsz=true", "actor.ppo_micro_batch_size_per_gpu=2",
                    "actor.log_prob_micro_batch_size_per_gpu=8")
    assert ("actor.ppo_micro_batch_size_per_gpu = 2, actor.log_prob_micro_batch_size_per_gpu = 8 with "
            "actor.use_dynamic_bsz: the micro-batches are formed by actor.ppo_max_token_len_per_gpu tokens") in msg
    msg = errors_of(valid_file, "actor.ppo_max_token_len_per_gpu=2048")
    assert "actor.ppo_max_token_len_per_gpu = 2048 without actor.use_dynamic_bsz" in msg
    msg = errors_of(valid_file, "algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=true",
                    "critic.ppo_micro_batch_size_per_gpu=2")
    assert "critic.ppo_micro_batch_size_per_gpu = 2 with critic.use_dynamic_bsz" in msg
    msg = errors_of(valid_file, "algorithm.adv_estimator=gae", "critic.ppo_max_token_len_per_gpu=1024")
    assert "critic.ppo_max_token_len_per_gpu = 1024 without critic.use_dynamic_bsz" in msg
    # Each key where it is read: accepted.
    assert load_config(valid_file, ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=2048",
                                    "actor.ppo_micro_batch_size_per_gpu=4"]).actor.ppo_max_token_len_per_gpu == 2048
    assert load_config(valid_file, ["actor.ppo_micro_batch_size_per_gpu=2",
                                    "actor.log_prob_micro_batch_size_per_gpu=8"]).actor.ppo_micro_batch_size_per_gpu == 2
    cfg = load_config(valid_file, ["algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=true",
                                   "critic.ppo_max_token_len_per_gpu=1024"])
    assert cfg.critic.ppo_max_token_len_per_gpu == 1024


def test_recompute_granularity_needs_checkpointing(valid_file: Path) -> None:
    msg = errors_of(valid_file, "model.recompute_granularity=selective")
    assert "model.recompute_granularity = 'selective' without model.enable_gradient_checkpointing" in msg
    cfg = load_config(valid_file, ["model.enable_gradient_checkpointing=true", "model.recompute_granularity=selective"])
    assert cfg.model.recompute_granularity == "selective"


def test_epochs_and_a_step_count_are_not_both_set(valid_file: Path) -> None:
    msg = errors_of(valid_file, "trainer.total_epochs=7", "trainer.total_training_steps=100")
    assert "trainer.total_epochs = 7 with trainer.total_training_steps = 100" in msg
    assert load_config(valid_file, ["trainer.total_epochs=7"]).trainer.total_epochs == 7
    assert load_config(valid_file, ["trainer.total_training_steps=100"]).trainer.total_training_steps == 100
