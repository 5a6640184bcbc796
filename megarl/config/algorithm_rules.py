"""Rules on the algorithm's and the reward's keys: the KL penalty in the reward, each trained role's
optimizer and learning-rate schedule, the metric DAPO's dynamic sampling filters on, the built-in
scorers' options, and a reward model's combine, layout and pool.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from megarl.config.inert_keys import changed_keys
from megarl.config.layout_rules import check_layout
from megarl.config.rules import Rules, as_dict, dir_hf_config, pool_size, role_parallel
from megarl.config.schema import AlgorithmConfig, FilterGroupsConfig, KLControlConfig
from megarl.errors import ConfigError
from megarl.rewards.scorers import check_scorer_options  # standard library only, like these rules


def check_reward_kl_keys(r: Any, alg: Any) -> None:
    """algorithm.kl_penalty and algorithm.kl_ctrl.* shape the KL penalty in the reward only: refused when set
    without algorithm.use_kl_in_reward, and the adaptive controller's keys with a fixed one (they would do
    nothing). A key counts as set when it differs from its default."""
    defaults = KLControlConfig()
    if not alg.use_kl_in_reward:
        changed = [f"algorithm.kl_ctrl.{key} = {alg.kl_ctrl[key]!r}" for key in ("type", "kl_coef", "target_kl", "horizon")
                   if alg.kl_ctrl[key] != getattr(defaults, key)]
        if alg.kl_penalty != AlgorithmConfig.kl_penalty:
            changed.insert(0, f"algorithm.kl_penalty = {alg.kl_penalty!r}")
        if changed:
            r.err(f"{', '.join(changed)} without algorithm.use_kl_in_reward: these shape the KL penalty in the "
                  "reward only (the KL loss takes actor.kl_loss_type and actor.kl_loss_coef); set "
                  "algorithm.use_kl_in_reward: true or remove them")
    elif alg.kl_ctrl.type == "fixed":
        changed = [f"algorithm.kl_ctrl.{key} = {alg.kl_ctrl[key]!r}" for key in ("target_kl", "horizon")
                   if alg.kl_ctrl[key] != getattr(defaults, key)]
        if changed:
            r.err(f"{', '.join(changed)} with algorithm.kl_ctrl.type = 'fixed': only the adaptive controller "
                  "reads them (the fixed one keeps kl_coef); set type: adaptive or remove them")
    elif alg.kl_ctrl.target_kl <= 0:
        r.err(f"algorithm.kl_ctrl.target_kl = {alg.kl_ctrl.target_kl} with algorithm.kl_ctrl.type = 'adaptive': "
              "must be > 0 (the controller moves kl_coef by the measured KL / target_kl - 1)")


def check_optim(r: Rules, role: str) -> None:
    """`<role>.optim.*`: what Megatron's Adam and its LR schedule (megarl.megatron.optim) accept."""
    key, optim = f"{role}.optim", r.cfg[role].optim
    if optim.lr < 0:
        r.err(f"{key}.lr = {optim.lr}: must be >= 0")
    if optim.min_lr < 0:
        r.err(f"{key}.min_lr = {optim.min_lr}: must be >= 0")
    elif optim.min_lr > optim.lr >= 0:
        r.err(f"{key}.min_lr = {optim.min_lr}: must be <= {key}.lr = {optim.lr} (the decay goes from lr down to "
              "min_lr)")
    if optim.lr_warmup_steps == -1:
        r.err(f"{key}.lr_warmup_steps = -1: verl's 'use lr_warmup_steps_ratio' is 0 in megarl (0: warm up over "
              "lr_warmup_steps_ratio x the schedule's steps); set 0")
    elif optim.lr_warmup_steps < 0:
        r.err(f"{key}.lr_warmup_steps = {optim.lr_warmup_steps}: must be >= 0 (0: lr_warmup_steps_ratio x the "
              "schedule's steps)")
    if not 0 <= optim.lr_warmup_steps_ratio < 1:
        r.err(f"{key}.lr_warmup_steps_ratio = {optim.lr_warmup_steps_ratio}: must be in [0, 1) (the share of the "
              "schedule's steps spent warming up)")
    elif optim.lr_warmup_steps > 0 and optim.lr_warmup_steps_ratio != 0:
        r.err(f"{key}.lr_warmup_steps_ratio = {optim.lr_warmup_steps_ratio} with {key}.lr_warmup_steps = "
              f"{optim.lr_warmup_steps}: the steps are used and the ratio is never read; remove one of them")
    if optim.lr_scheduler == "constant" and optim.min_lr != 0 and not optim.min_lr > optim.lr >= 0:
        r.err(f"{key}.min_lr = {optim.min_lr} with {key}.lr_scheduler = 'constant': only a decaying schedule "
              "(cosine, linear) reads it; remove it or set lr_scheduler")
    betas = list(optim.betas)
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        r.err(f"{key}.betas = {betas}: must be a list of 2 numbers in [0, 1) (Adam's beta1 and beta2, e.g. "
              "[0.9, 0.999])")
    if not optim.eps > 0:
        r.err(f"{key}.eps = {optim.eps}: must be > 0 (Adam's denominator term, e.g. 1e-8)")


# What `algorithm.filter_groups.metric` can name (megarl.algorithms.dapo.sequence_metric): a per-response
# sum (dapo.TENSOR_METRICS; dapo imports torch, a test keeps them equal) or a key of the rows'
# reward_info. The built-in scorers return score, acc and format (megarl.rewards.scorers), the reward
# manager adds failed; overlong shaping adds overlong_penalty, multi-turn rollouts tool_reward, and a
# reward model rm_score (megarl.rewards.model_scores.combine_scores).
FILTER_SUMS = ("seq_reward", "seq_final_reward")
BUILTIN_REWARD_INFO = ("score", "acc", "format", "failed")


def filter_metrics(cfg: DictConfig) -> list[str]:
    """The values of algorithm.filter_groups.metric that the built-in scorers (and a reward model) give."""
    if cfg.reward_model.enable:
        # The rule scorers' keys are 0 on the rows the reward model scores alone: not a metric of those rows.
        return [*FILTER_SUMS, "rm_score"]
    names = [*FILTER_SUMS, *BUILTIN_REWARD_INFO]
    if cfg.reward.overlong_buffer.enable:
        names.append("overlong_penalty")
    if cfg.rollout.multi_turn.enable:
        names.append("tool_reward")
    return names


def check_filter_metric(r: Rules, cfg: DictConfig) -> None:
    """algorithm.filter_groups.metric: one the run's scoring computes for every row."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        changed = changed_keys("algorithm.filter_groups", fg, FilterGroupsConfig, skip=("enable",))
        if changed:
            r.err(f"{', '.join(changed)} without algorithm.filter_groups.enable: only DAPO's dynamic sampling "
                  "reads them; remove them or enable it")
        return
    valid = filter_metrics(cfg)
    if fg.metric in valid:
        return
    if cfg.reward_model.enable:
        r.err(f"algorithm.filter_groups.metric = {fg.metric!r} with reward_model.enable: a row the reward model "
              "scores alone (reward_model.style 'model') carries 0 in the rule scorer's keys, so every such group "
              "would look uniform and be dropped; use seq_reward (each response's combined score); valid: "
              f"{valid}")
    elif not cfg.reward.custom_reward_function.path:  # a custom function may return any key
        r.err(f"algorithm.filter_groups.metric = {fg.metric!r}: the built-in scorers do not compute it; valid: "
              f"{valid} (a custom reward function, reward.custom_reward_function.path, may return other keys)")


def check_reward_kwargs(r: Rules, cfg: DictConfig) -> None:
    """reward.reward_kwargs against the built-in scorers' options (with a custom function they are its own)."""
    if cfg.reward.custom_reward_function.path:
        return
    options = as_dict(cfg.reward.reward_kwargs)
    for name, value in options.items():
        if not isinstance(value, dict):
            r.err(f"reward.reward_kwargs.{name} = {value!r}: must be a mapping of the scorer's options, e.g. "
                  "{arithmetic: {mode: startswith}}")
            return
    try:
        check_scorer_options(options)
    except ConfigError as exc:
        msg = str(exc)
        r.err(f"reward.{msg}" if msg.startswith("reward_kwargs") else f"reward.reward_kwargs: {msg}")


# megarl.rewards.model_scores.COMBINES, which imports torch (a test keeps them equal).
REWARD_MODEL_COMBINES = ("by_style", "weighted_sum")


def check_reward_model(r: Rules, cfg: DictConfig) -> None:
    """`reward_model.*`: combine, layout and pool (its checkpoint: run_files.reward_model_checkpoint_problems)."""
    rm, res = cfg.reward_model, cfg.resources
    if rm.combine not in REWARD_MODEL_COMBINES:
        r.err(f"reward_model.combine = {rm.combine!r}; valid: {list(REWARD_MODEL_COMBINES)}")
    r.positive("reward_model.micro_batch_size_per_gpu")
    if not rm.model_path:
        r.err("reward_model.enable = true needs reward_model.model_path (a HF sequence-classification directory "
              "with one label)")
        return
    hf = dir_hf_config(r, rm.model_path, "reward_model.model_path")
    world = pool_size(res.reward_model_pool) if res.reward_model_pool is not None else pool_size(res.actor_pool)
    pool_key = "resources.reward_model_pool" if res.reward_model_pool is not None else "resources.actor_pool"
    check_layout(r, "reward_model", role_parallel(cfg, "reward_model"), world, pool_key, hf)
    if res.reward_model_pool is None and rm.megatron is not None and as_dict(rm.megatron) != as_dict(cfg.actor.megatron):
        r.err("reward_model.megatron differs from actor.megatron, but the reward model shares the actor's processes "
              "(resources.reward_model_pool is null); set reward_model.megatron to null (the actor's layout) or "
              "give the reward model its own pool")
