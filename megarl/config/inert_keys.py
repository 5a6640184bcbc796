"""Keys set where the config never reads them: a value the run would silently ignore is refused.

verl accepts, say, `algorithm.gamma: 0.99` beside GRPO and trains without discounting; here each
rule names the keys set to other than their default, why nothing reads them in this config, and
what to set instead. The rules know which built-in algorithm reads which key; a user-registered
estimator or loss receives every setting, so its config is never refused for them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from megarl.config.schema import (ActorConfig, AlgorithmConfig, CriticConfig, CustomRewardFunctionConfig,
                                  DataConfig, ModelConfig, MultiTurnConfig, OptimConfig, OverlongBufferConfig, RefConfig,
                                  RewardConfig, RewardModelConfig, RolloutConfig, RolloutCorrectionConfig,
                                  TrackingConfig, TrainerConfig, ValidationSamplingConfig)

# megarl.algorithms.policy_loss: the built-in losses that read each clipping key (clip_ratio is the
# default of clip_ratio_low and clip_ratio_high).
DUAL_CLIP_LOSSES = {"vanilla"}
CLIPPING_LOSSES = {"vanilla", "gspo", "cispo"}
# megarl.algorithms.advantages: the built-in estimators that read each algorithm.* setting.
ESTIMATOR_KEYS = {
    "gamma": {"gae", "reinforce_plus_plus"},
    "lam": {"gae"},
    "norm_adv_by_std_in_grpo": {"grpo", "grpo_passk"},
}
# megarl.algorithms.rollout_correction: the modes that read each band key.
CORRECTION_KEYS = {"threshold": {"tis"}, "lower": {"mis", "icepop", "reject"}, "upper": {"mis", "icepop", "reject"}}
# reward.* keys that configure the worker pool of a custom reward function (megarl.rewards.manager:
# built-in scorers run in the driver process).
POOL_KEYS = ("num_workers", "timeout_s", "batch_timeout_s", "worker_memory_mb")
# rollout.val_kwargs keys that only sampled validation reads (megarl.rollout.sampling and vLLM's
# request take none of them for argmax decoding); n is refused apart (n identical responses).
VAL_SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def changed_keys(section: str, current: Any, default: Any, skip: tuple[str, ...] = (),
                 only: Optional[tuple[str, ...]] = None) -> list[str]:
    """`key = value` for each key of `section` (`only` those named, when given) whose value differs from
    the schema's default; `current` and `default` are dicts or, for the section's config and its
    dataclass, anything `OmegaConf.to_container` / `dataclasses.asdict` turn into one (a section that
    is null by default counts as one key when set)."""
    if not isinstance(current, dict):
        current = OmegaConf.to_container(current, resolve=True) if current is not None else {}
    default = default if isinstance(default, dict) else dataclasses.asdict(default())
    out = []
    for name, value in current.items():
        if name in skip or (only is not None and name not in only):
            continue
        base, key = default.get(name), f"{section}.{name}"
        if isinstance(value, dict) and isinstance(base, dict):
            out += changed_keys(key, value, base)
        elif value != base:
            out.append(f"{key} = {value!r}")
    return out


def inert_key_errors(cfg: DictConfig, *, critic_on: bool, ref_on: bool, builtin_estimators: set[str],
                     builtin_losses: set[str]) -> list[str]:
    """A message for each group of keys set (to other than their default) where `cfg` never reads them."""
    errors = (_algorithm_errors(cfg, builtin_estimators, builtin_losses) + _role_and_run_errors(cfg, ref_on)
              + _micro_batch_errors(cfg, critic_on) + _schedule_errors(cfg, critic_on)
              + _validation_errors(cfg) + _rollout_and_tracking_errors(cfg))
    actor, rm, reward = cfg.actor, cfg.reward_model, cfg.reward
    if not actor.use_kl_loss:
        changed = changed_keys("actor", actor, ActorConfig, only=("kl_loss_coef", "kl_loss_type"))
        if changed:
            errors.append(f"{', '.join(changed)} without actor.use_kl_loss: only the KL loss reads them (the KL "
                          "penalty in the reward takes algorithm.kl_ctrl.kl_coef and algorithm.kl_penalty); set "
                          "actor.use_kl_loss: true or remove them")
    if not critic_on:
        changed = changed_keys("critic", cfg.critic, CriticConfig, skip=("enable",))
        if changed:
            why = ("critic.enable = false" if cfg.critic.enable is False
                   else f"critic.enable = null and algorithm.adv_estimator = {cfg.algorithm.adv_estimator!r}")
            errors.append(f"{', '.join(changed)} with no critic ({why}): only a critic reads them; remove them or "
                          "set critic.enable: true")
    if not rm.enable:
        changed = changed_keys("reward_model", rm, RewardModelConfig, skip=("enable",))
        if changed:
            errors.append(f"{', '.join(changed)} with reward_model.enable = false: only a reward model reads them; "
                          "remove them or set reward_model.enable: true")
    elif rm.combine == "by_style":
        changed = changed_keys("reward_model", rm, RewardModelConfig, only=("rule_weight", "model_weight"))
        if changed:
            errors.append(f"{', '.join(changed)} with reward_model.combine = 'by_style': each row takes its rule or "
                          "its model score as it is, unweighted; remove them or set combine: weighted_sum")
    overlong = reward.overlong_buffer
    if not overlong.enable:
        changed = changed_keys("reward.overlong_buffer", overlong, OverlongBufferConfig, only=("len", "penalty_factor"))
        if changed:
            errors.append(f"{', '.join(changed)} without reward.overlong_buffer.enable: no overlong penalty is "
                          "computed; set reward.overlong_buffer.enable: true or remove them")
    if not reward.custom_reward_function.path:
        changed = changed_keys("reward", reward, RewardConfig, only=POOL_KEYS)
        if changed:
            errors.append(f"{', '.join(changed)} with the built-in scorers only (reward.custom_reward_function.path "
                          "unset): these configure the worker pool of a custom reward function, the built-in scorers "
                          "run in the driver; remove them or set reward.custom_reward_function.path")
        name = reward.custom_reward_function.name
        if name != CustomRewardFunctionConfig.name:
            errors.append(f"reward.custom_reward_function.name = {name!r} without reward.custom_reward_function.path: "
                          "the built-in scorers score the rows; set the path of the file that defines it or remove "
                          "the name")
    return errors


def _role_and_run_errors(cfg: DictConfig, ref_on: bool) -> list[str]:
    """The reference policy's, recomputation's and the run length's settings."""
    errors = []
    if not ref_on:
        changed = changed_keys("ref", cfg.ref, RefConfig, skip=("enable",))
        if changed:
            errors.append(f"{', '.join(changed)} with no reference policy (ref.enable = {cfg.ref.enable}, and no KL "
                          "term: actor.use_kl_loss and algorithm.use_kl_in_reward are false): only a reference reads "
                          "them; remove them or turn a KL term on")
    elif cfg.actor.use_dynamic_bsz and cfg.ref.log_prob_micro_batch_size_per_gpu != RefConfig.log_prob_micro_batch_size_per_gpu:
        errors.append(f"ref.log_prob_micro_batch_size_per_gpu = {cfg.ref.log_prob_micro_batch_size_per_gpu} with "
                      "actor.use_dynamic_bsz: the reference's pass follows the actor's and splits its micro-batches by "
                      "actor.ppo_max_token_len_per_gpu tokens, not by sequences; remove it")
    if not cfg.model.enable_gradient_checkpointing and cfg.model.recompute_granularity != ModelConfig.recompute_granularity:
        errors.append(f"model.recompute_granularity = {cfg.model.recompute_granularity!r} without "
                      "model.enable_gradient_checkpointing: nothing is recomputed; set "
                      "model.enable_gradient_checkpointing: true or remove it")
    trainer = cfg.trainer
    if trainer.total_training_steps is not None and trainer.total_epochs != TrainerConfig.total_epochs:
        errors.append(f"trainer.total_epochs = {trainer.total_epochs} with trainer.total_training_steps = "
                      f"{trainer.total_training_steps}: the run takes that many steps whatever the epochs (the data "
                      "loader starts another epoch as needed; verl stops at whichever comes first); set one of them")
    return errors


def _micro_batch_errors(cfg: DictConfig, critic_on: bool) -> list[str]:
    """Micro-batches by sequences or by tokens (megarl.megatron.engine): `use_dynamic_bsz` reads
    `ppo_max_token_len_per_gpu` and no micro-batch size, otherwise the reverse. The actor's budget is
    also the reference's (read under actor.use_dynamic_bsz only); the reward model's pass always
    splits by its own micro_batch_size_per_gpu."""
    roles = [("actor", cfg.actor, ActorConfig, ("ppo_micro_batch_size_per_gpu", "log_prob_micro_batch_size_per_gpu"))]
    if critic_on:  # else the critic's rule refuses every critic key set
        roles.append(("critic", cfg.critic, CriticConfig, ("ppo_micro_batch_size_per_gpu",)))
    errors = []
    for role, sec, schema, sizes in roles:
        if sec.use_dynamic_bsz:
            changed = changed_keys(role, sec, schema, only=sizes)
            if changed:
                errors.append(f"{', '.join(changed)} with {role}.use_dynamic_bsz: the micro-batches are formed by "
                              f"{role}.ppo_max_token_len_per_gpu tokens, not by sequences; remove them or set "
                              f"{role}.use_dynamic_bsz: false")
        else:
            changed = changed_keys(role, sec, schema, only=("ppo_max_token_len_per_gpu",))
            if changed:
                errors.append(f"{changed[0]} without {role}.use_dynamic_bsz: the micro-batches take "
                              f"{role}.ppo_micro_batch_size_per_gpu sequences; set {role}.use_dynamic_bsz: true "
                              "or remove it")
    return errors


def _validation_errors(cfg: DictConfig) -> list[str]:
    """Keys only validation reads (megarl.trainer.loop), set where there is no validation set.
    `trainer.val_before_train: false` is left out: it agrees with a run that never validates."""
    if cfg.data.val_files:
        return []
    changed = (changed_keys("data", cfg.data, DataConfig, only=("val_batch_size",))
               + changed_keys("trainer", cfg.trainer, TrainerConfig, only=("test_freq", "validation_data_dir"))
               + changed_keys("rollout.val_kwargs", cfg.rollout.val_kwargs, ValidationSamplingConfig))
    if not changed:
        return []
    return [f"{', '.join(changed)} with no data.val_files: only validation reads them, and without a validation "
            "set the run never validates; add data.val_files or remove them"]


def _algorithm_errors(cfg: DictConfig, builtin_estimators: set[str], builtin_losses: set[str]) -> list[str]:
    """The advantage estimator's, the policy loss's and the rollout correction's settings."""
    errors = []
    alg, actor = cfg.algorithm, cfg.actor
    estimator = alg.adv_estimator
    if estimator in builtin_estimators:
        unread = [key for key, readers in ESTIMATOR_KEYS.items() if estimator not in readers]
        changed = changed_keys("algorithm", alg, AlgorithmConfig, only=tuple(unread))
        if changed:
            readers = "; ".join(f"{key}: {', '.join(sorted(ESTIMATOR_KEYS[key]))}"
                                for key in unread if any(c.startswith(f"algorithm.{key} ") for c in changed))
            errors.append(f"{', '.join(changed)} with algorithm.adv_estimator = {estimator!r}: that estimator does "
                          f"not read them (read by {readers}); remove them or choose an estimator that does")
    loss_mode = actor.policy_loss.loss_mode
    if loss_mode in builtin_losses - CLIPPING_LOSSES:
        changed = changed_keys("actor", actor, ActorConfig,
                               only=("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c"))
        if changed:
            errors.append(f"{', '.join(changed)} with actor.policy_loss.loss_mode = {loss_mode!r}: that loss takes "
                          f"no ratio to clip; remove them or set a clipping loss ({', '.join(sorted(CLIPPING_LOSSES))})")
    elif loss_mode in builtin_losses - DUAL_CLIP_LOSSES and actor.clip_ratio_c != ActorConfig.clip_ratio_c:
        errors.append(f"actor.clip_ratio_c = {actor.clip_ratio_c} with actor.policy_loss.loss_mode = {loss_mode!r}: "
                      f"only the dual-clip PPO loss ({', '.join(sorted(DUAL_CLIP_LOSSES))}) reads it; remove it or "
                      "set loss_mode vanilla")
    corr = alg.rollout_correction
    unread = [key for key, modes in CORRECTION_KEYS.items() if corr.mode not in modes]
    if corr.mode == "none":
        unread.append("level")
    changed = changed_keys("algorithm.rollout_correction", corr, RolloutCorrectionConfig, only=tuple(unread))
    if changed:
        errors.append(f"{', '.join(changed)} with algorithm.rollout_correction.mode = {corr.mode!r}: that mode does "
                      "not read them (threshold: tis; lower and upper: mis, icepop, reject; level: every mode but "
                      "none); remove them or set the mode that uses them")
    return errors


def _schedule_errors(cfg: DictConfig, critic_on: bool) -> list[str]:
    """`<role>.optim.total_training_steps`, the LR schedule's length (megarl.trainer.run_spec._engine_config):
    read by a decaying schedule (the decay ends there) and by a warmup of lr_warmup_steps_ratio x it
    (lr_warmup_steps 0); a constant schedule warmed up over lr_warmup_steps, or not at all, never
    reaches it. The critic's with no critic are refused with the other critic.* keys."""
    errors = []
    for role in ("actor", "critic") if critic_on else ("actor",):
        key, optim = f"{role}.optim", cfg[role].optim
        steps = optim.total_training_steps
        if steps == OptimConfig.total_training_steps or optim.lr_scheduler != "constant":
            continue
        if optim.lr_warmup_steps == 0 and optim.lr_warmup_steps_ratio > 0:
            continue  # the warmup is that share of the schedule's steps
        warmup = (f"{key}.lr_warmup_steps = {optim.lr_warmup_steps} (the warmup counted in steps)"
                  if optim.lr_warmup_steps > 0 else f"no warmup ({key}.lr_warmup_steps_ratio = 0)")
        errors.append(f"{key}.total_training_steps = {steps} with {key}.lr_scheduler = 'constant' and {warmup}: "
                      "the schedule's length is read only by a decaying schedule (cosine, linear: the decay ends "
                      "there) and by a warmup of lr_warmup_steps_ratio of it; remove it or set one of those")
    return errors


def logprob_gap_uncheckable(temperature: float, top_p: float, top_k: int, logprobs_mode: str) -> Optional[str]:
    """Why the rollout engine's log-probs of sampled tokens are not the trainer's quantity,
    ``log_softmax(logits / temperature)``, under this sampling (then their gap measures the sampling,
    not the weights, and `rollout.max_logprob_gap` cannot be checked on it); None when they are.
    Torch-free, here for the config check; the trainer takes it through `megarl.algorithms`."""
    if logprobs_mode == "raw" and temperature != 1.0:
        return (f"rollout.logprobs_mode = 'raw' gives log_softmax(logits), the trainer log_softmax(logits / "
                f"{temperature:g}) (rollout.temperature)")
    filters = [f"rollout.top_p = {top_p:g}" if top_p < 1.0 else "", f"rollout.top_k = {top_k}" if top_k > 0 else ""]
    if logprobs_mode == "processed" and any(filters):
        return (f"{' and '.join(f for f in filters if f)} with rollout.logprobs_mode = 'processed': the rollout's "
                "log-probs are of the filtered, renormalised distribution, the trainer's of the whole one (their gap "
                "is -log of the mass kept)")
    return None


def _rollout_and_tracking_errors(cfg: DictConfig) -> list[str]:
    """Multi-turn settings, validation sampling, the weight-sync probe and the log-prob gap, mlflow's store."""
    errors = []
    rollout = cfg.rollout
    if not rollout.multi_turn.enable:
        changed = changed_keys("rollout.multi_turn", rollout.multi_turn, MultiTurnConfig, skip=("enable",))
        if changed:
            errors.append(f"{', '.join(changed)} with rollout.multi_turn.enable = false: only the multi-turn agent "
                          "loop reads them (each response is one turn, no tool runs); set rollout.multi_turn.enable: "
                          "true or remove them")
    if not rollout.val_kwargs.do_sample:
        changed = changed_keys("rollout.val_kwargs", rollout.val_kwargs, ValidationSamplingConfig,
                               only=VAL_SAMPLING_KEYS)
        if changed:
            errors.append(f"{', '.join(changed)} with rollout.val_kwargs.do_sample = false: validation decodes by "
                          "argmax, which takes no temperature, top_p or top_k; set do_sample: true or remove them")
    probe_off = rollout.probe_freq == 0
    if probe_off and rollout.probe_prompts != RolloutConfig.probe_prompts:
        errors.append(f"rollout.probe_prompts = {rollout.probe_prompts} with rollout.probe_freq = 0: only the "
                      "weight-sync probe reads it (the size of its batch); set rollout.probe_freq >= 1 or remove it")
    gap = rollout.max_logprob_gap
    uncheckable = logprob_gap_uncheckable(rollout.temperature, rollout.top_p, rollout.top_k, rollout.logprobs_mode)
    # null is read (no warning at the start that the check is skipped).
    gap_set = gap is not None and gap != RolloutConfig.max_logprob_gap
    if probe_off and gap_set and not rollout.calculate_log_probs:
        errors.append(f"rollout.max_logprob_gap = {gap} with rollout.calculate_log_probs = false and "
                      "rollout.probe_freq = 0: the per-step check compares the rollout's log-probs, which are not "
                      "kept, and no probe runs, so nothing compares a gap with it; set calculate_log_probs: true or "
                      "rollout.probe_freq >= 1, or remove it")
    elif probe_off and gap_set and uncheckable:
        # The probe samples without top-p / top-k, and is refused with raw log-probs at a temperature.
        fix = ("use logprobs_mode processed (or temperature 1)" if rollout.logprobs_mode == "raw"
               else "set rollout.probe_freq >= 1 (the probe samples without the filters), sample without them")
        errors.append(f"rollout.max_logprob_gap = {gap} with rollout.probe_freq = 0: the per-step check is skipped "
                      f"under this sampling ({uncheckable}) and no probe runs, so nothing compares a gap with it; "
                      f"{fix}, or remove it")
    tracking = cfg.tracking
    if tracking.mlflow_tracking_uri != TrackingConfig.mlflow_tracking_uri and "mlflow" not in tracking.backends:
        errors.append(f"tracking.mlflow_tracking_uri = {tracking.mlflow_tracking_uri!r} with tracking.backends = "
                      f"{list(tracking.backends)}: only the mlflow backend reads it; add mlflow to tracking.backends "
                      "or remove it")
    return errors
