"""The experiment resolved once, on the driver, into the typed specs the worker roles receive.

This is the one translator from config keys to engine settings, parallel layouts, rollout options
and sampling parameters: roles get `EngineRoleSpec` / `RolloutSpec` objects, never the config.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from megarl.agent.loop import AgentSettings
from megarl.config import critic_enabled, ref_enabled
from megarl.algorithms import RolloutCorrectionSettings, logprob_gap_uncheckable
from megarl.config.rollout_rules import ROLLOUT_SEED_FACTOR, optimizer_steps_per_step, update_is_on_policy
from megarl.config.rules import role_parallel
from megarl.dtypes import long_name, short_name
from megarl.layout import ParallelLayout
from megarl.megatron.optim import EngineConfig
from megarl.rewards.model_scores import RewardCombine
from megarl.rollout.base import EngineOptions, SamplingParams
from megarl.rollout.partial import PartialRollout
from megarl.workers.losses import ActorLossSpec, CriticLossSpec, zero_advantage_rows_add_nothing
from megarl.workers.specs import EngineRoleSpec, OffloadSpec, RolloutSpec, UpdateSpec


@dataclass(frozen=True)
class RunSpec:
    """Every role's spec, and the sampling parameters of training and validation.

    `train_sampling`/`val_sampling` carry no seed: the driver sets one per call.
    """

    actor: EngineRoleSpec
    rollout: RolloutSpec
    ref: Optional[EngineRoleSpec]
    critic: Optional[EngineRoleSpec]
    train_sampling: SamplingParams
    val_sampling: SamplingParams
    response_length: int
    reward_model: Optional[EngineRoleSpec] = None
    reward_combine: RewardCombine = RewardCombine()
    max_logprob_gap: Optional[float] = None  # rollout.max_logprob_gap: the driver stops the run above it
    # Why the training rows' rollout log-probs cannot be compared with the trainer's (sampling filters,
    # raw log-probs at a temperature): the step's gap check is then skipped; None: it runs.
    logprob_gap_uncheckable: Optional[str] = None


def response_length(cfg: DictConfig) -> int:
    """Tokens generated per response: `rollout.response_length`, else `data.max_response_length`."""
    return int(cfg.rollout.response_length or cfg.data.max_response_length)


def parallel_layout(par: Any) -> ParallelLayout:
    """A role's `megatron` section as a layout (dp derived from the pool when workers start)."""
    return ParallelLayout(tp=int(par.tensor_model_parallel_size), pp=int(par.pipeline_model_parallel_size),
                          cp=int(par.context_parallel_size), ep=int(par.expert_model_parallel_size),
                          etp=int(par.expert_tensor_parallel_size or 0), dp=int(par.data_parallel_size or 0))


def _engine_config(cfg: DictConfig, optim: Any, role: str, par: Any, total_steps: int, micro: int,
                   log_prob_micro: int, use_dynamic_bsz: bool, max_tokens: int, trained: bool = True,
                   per_step: int = 1) -> EngineConfig:
    """`optim`'s schedule counts trainer steps (`total_training_steps`, null: the run's; the warmup);
    the engine advances its schedule at every optimizer step, `per_step` of them a trainer step."""
    schedule_steps = int(optim.total_training_steps or max(1, total_steps))
    warmup = optim.lr_warmup_steps or int(optim.lr_warmup_steps_ratio * schedule_steps)
    model = cfg.model
    return EngineConfig(
        role=role,
        dtype=short_name(model.dtype, "model.dtype"),
        seed=int(cfg.trainer.seed),
        lr=float(optim.lr),
        min_lr=float(optim.min_lr),
        betas=tuple(float(b) for b in optim.betas),
        eps=float(optim.eps),
        weight_decay=float(optim.weight_decay),
        clip_grad=float(optim.clip_grad),
        lr_schedule=str(optim.lr_scheduler),
        lr_warmup_steps=int(warmup) * per_step,
        total_training_steps=schedule_steps * per_step,
        micro_batch_size=int(micro),
        log_prob_micro_batch_size=int(log_prob_micro),
        use_dynamic_bsz=bool(use_dynamic_bsz),
        max_token_len_per_micro_batch=int(max_tokens),
        use_sequence_packing=bool(model.use_remove_padding),
        prompt_sharing=str(model.prompt_sharing),
        use_distributed_optimizer=bool(optim.use_distributed_optimizer),
        sequence_parallel=bool(par.sequence_parallel),
        recompute_granularity=str(model.recompute_granularity) if model.enable_gradient_checkpointing else None,
        # A frozen role never sums gradients: it gets no shared memory for them.
        host_grad_reduce=trained and str(cfg.resources.cpu_grad_reduce) == "shared_memory",
        trained=trained,
    )


def resolve_run_spec(cfg: DictConfig, model_dir: str, pad_token_id: int, eos_token_ids: list[int],
                     total_steps: int) -> RunSpec:
    """The specs of every role of a validated experiment. `model_dir`: the run's initial HF model."""
    resp = response_length(cfg)
    temperature = float(cfg.rollout.temperature)
    n = int(cfg.rollout.n)
    family = cfg.model.spec or None

    actor = cfg.actor
    actor_loss = ActorLossSpec(
        loss_mode=str(actor.policy_loss.loss_mode),
        clip_ratio_low=float(actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio),
        clip_ratio_high=float(actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio),
        clip_ratio_c=float(actor.clip_ratio_c),
        loss_agg_mode=str(actor.loss_agg_mode),
        entropy_coeff=float(actor.entropy_coeff),
        use_kl_loss=bool(actor.use_kl_loss),
        kl_loss_coef=float(actor.kl_loss_coef),
        kl_loss_type=str(actor.kl_loss_type),
        old_log_prob_source=old_log_prob_source(cfg),
        rollout_correction=rollout_correction_settings(cfg.algorithm.rollout_correction),
        import_modules=tuple(os.path.abspath(m) if str(m).endswith(".py") else str(m)
                             for m in cfg.algorithm.import_modules),
    )
    # Left out of the update only where they add nothing to its gradient (actor.skip_zero_advantage_rows).
    actor_loss = dataclasses.replace(actor_loss, skip_zero_advantage_rows=bool(
        actor.skip_zero_advantage_rows and zero_advantage_rows_add_nothing(actor_loss)))
    actor_spec = EngineRoleSpec(
        name="actor",
        model_dir=str(model_dir),
        layout=parallel_layout(actor.megatron),
        engine=_engine_config(cfg, actor.optim, "policy", actor.megatron, total_steps,
                              micro=actor.ppo_micro_batch_size_per_gpu,
                              log_prob_micro=actor.log_prob_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu,
                              use_dynamic_bsz=actor.use_dynamic_bsz, max_tokens=actor.ppo_max_token_len_per_gpu,
                              per_step=optimizer_steps_per_step(cfg, actor)),
        offload=OffloadSpec(params=bool(actor.param_offload), grads=bool(actor.grad_offload),
                            optimizer=bool(actor.optimizer_offload)),
        temperature=temperature,
        max_response_length=resp,
        update=UpdateSpec(mini_batch_sequences=int(actor.ppo_mini_batch_size) * n, epochs=int(actor.ppo_epochs),
                          shuffle=bool(actor.shuffle)),
        loss=actor_loss,
        family=family,
    )

    ref_spec = None
    if ref_enabled(cfg):
        ref = cfg.ref
        par = role_parallel(cfg, "ref")
        micro = int(ref.log_prob_micro_batch_size_per_gpu)
        ref_spec = EngineRoleSpec(
            name="ref",
            model_dir=str(model_dir),
            layout=parallel_layout(par),
            # A frozen role: no optimizer is built (the actor's settings shape nothing). Its log-prob
            # pass is micro-batched as the actor's (verl's ref.log_prob_use_dynamic_bsz default):
            # by actor.ppo_max_token_len_per_gpu tokens under actor.use_dynamic_bsz.
            engine=_engine_config(cfg, actor.optim, "policy", par, total_steps, micro=micro, log_prob_micro=micro,
                                  use_dynamic_bsz=actor.use_dynamic_bsz, max_tokens=actor.ppo_max_token_len_per_gpu,
                                  trained=False),
            offload=OffloadSpec(params=bool(ref.param_offload)),
            temperature=temperature,
            max_response_length=resp,
            family=family,
        )

    critic_spec = None
    if critic_enabled(cfg):
        critic = cfg.critic
        par = role_parallel(cfg, "critic")
        critic_spec = EngineRoleSpec(
            name="critic",
            model_dir=str(critic.model_path or model_dir),
            layout=parallel_layout(par),
            engine=_engine_config(cfg, critic.optim, "value", par, total_steps,
                                  micro=critic.ppo_micro_batch_size_per_gpu,
                                  log_prob_micro=critic.ppo_micro_batch_size_per_gpu,
                                  use_dynamic_bsz=critic.use_dynamic_bsz, max_tokens=critic.ppo_max_token_len_per_gpu,
                                  per_step=optimizer_steps_per_step(cfg, critic)),
            # Megatron's DDP keeps gradients in a buffer beside the parameters: they move together.
            offload=OffloadSpec(params=bool(critic.param_offload), grads=bool(critic.param_offload),
                                optimizer=bool(critic.optimizer_offload)),
            temperature=temperature,
            max_response_length=resp,
            update=UpdateSpec(mini_batch_sequences=int(critic.ppo_mini_batch_size) * n,
                              epochs=int(critic.ppo_epochs), shuffle=bool(critic.shuffle)),
            loss=CriticLossSpec(cliprange_value=float(critic.cliprange_value), loss_agg_mode=str(critic.loss_agg_mode)),
            family=family,
        )

    rm_spec = None
    rm = cfg.reward_model
    if rm.enable:
        par = role_parallel(cfg, "reward_model")
        micro = int(rm.micro_batch_size_per_gpu)
        rm_spec = EngineRoleSpec(
            name="reward_model",
            model_dir=str(rm.model_path),
            layout=parallel_layout(par),
            # Frozen: no optimizer is built (the actor's settings shape nothing).
            engine=_engine_config(cfg, actor.optim, "reward", par, total_steps, micro=micro, log_prob_micro=micro,
                                  use_dynamic_bsz=False, max_tokens=actor.ppo_max_token_len_per_gpu, trained=False),
            offload=OffloadSpec(params=bool(rm.param_offload)),
            max_response_length=resp,
        )

    ro = cfg.rollout
    rollout_spec = RolloutSpec(
        model_dir=str(model_dir),
        engine=str(ro.engine),
        options=EngineOptions(
            pad_token_id=int(pad_token_id),
            eos_token_ids=tuple(int(t) for t in eos_token_ids),
            dtype=long_name(ro.dtype or cfg.model.dtype, "rollout.dtype"),
            seed=int(cfg.trainer.seed) * ROLLOUT_SEED_FACTOR,  # rank r's engine uses seed + r
            tensor_parallel_size=int(ro.tensor_model_parallel_size),
            logprobs_mode=str(ro.logprobs_mode),
            max_model_len=int(cfg.data.max_prompt_length) + resp,
            max_num_seqs=int(ro.max_num_seqs),
            kv_cache_memory_gb=float(ro.kv_cache_memory_gb),
            gpu_memory_utilization=float(ro.gpu_memory_utilization),
            enforce_eager=bool(ro.enforce_eager),
            enable_sleep_mode=bool(ro.free_cache_engine),
            sleep_level=int(ro.sleep_level),
        ),
        tensor_parallel_size=int(ro.tensor_model_parallel_size),
        free_cache_engine=bool(ro.free_cache_engine),
        sync_bucket_bytes=int(ro.update_weights_bucket_mb) * 2**20,
        sync_verify_freq=int(ro.sync_verify_freq),
        calculate_log_probs=bool(ro.calculate_log_probs),
        multi_turn=multi_turn_settings(cfg.rollout.multi_turn, resp, cfg.data.apply_chat_template_kwargs),
        partial=partial_rollout_settings(cfg.trainer),
    )

    val = ro.val_kwargs
    return RunSpec(
        actor=actor_spec,
        rollout=rollout_spec,
        ref=ref_spec,
        critic=critic_spec,
        train_sampling=SamplingParams(n=n, temperature=temperature, top_p=float(ro.top_p), top_k=int(ro.top_k),
                                      max_new_tokens=resp, ignore_eos=bool(ro.ignore_eos)),
        val_sampling=SamplingParams(n=int(val.n), temperature=float(val.temperature) if val.do_sample else 1.0,
                                    top_p=float(val.top_p), top_k=int(val.top_k), max_new_tokens=resp,
                                    greedy=not val.do_sample, ignore_eos=bool(ro.ignore_eos)),
        response_length=resp,
        reward_model=rm_spec,
        reward_combine=RewardCombine(str(rm.combine), float(rm.rule_weight), float(rm.model_weight)),
        max_logprob_gap=float(ro.max_logprob_gap) if ro.max_logprob_gap is not None else None,
        logprob_gap_uncheckable=logprob_gap_uncheckable(temperature, float(ro.top_p), int(ro.top_k),
                                                        str(ro.logprobs_mode)),
    )


def with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=int(seed))


def old_log_prob_source(cfg: DictConfig) -> str:
    """`actor.old_log_prob_source` with auto resolved: the update's own log-probs when the update is
    on-policy and nothing needs them before it (the KL in the reward does), else the recompute pass."""
    source = str(cfg.actor.old_log_prob_source)
    if source != "auto":
        return source
    return "update" if update_is_on_policy(cfg) and not cfg.algorithm.use_kl_in_reward else "recompute"


def rollout_correction_settings(rollout_correction: Any) -> RolloutCorrectionSettings:
    """`algorithm.rollout_correction.*` as the actor loss's correction settings."""
    return RolloutCorrectionSettings(mode=str(rollout_correction.mode), level=str(rollout_correction.level),
                                     threshold=float(rollout_correction.threshold),
                                     lower=float(rollout_correction.lower), upper=float(rollout_correction.upper))


def partial_rollout_settings(trainer: Any) -> Optional[PartialRollout]:
    """`trainer.partial_rollout*` as the rollout's chunked-generation settings (None when off)."""
    if trainer.partial_rollout == "off":
        return None
    after = trainer.partial_rollout_interrupt_after
    return PartialRollout(mode=str(trainer.partial_rollout), chunk_tokens=int(trainer.partial_rollout_chunk_tokens),
                          interrupt_after=None if after is None else int(after))


def multi_turn_settings(multi_turn: Any, response_length: int, chat_template_kwargs: Any = None
                        ) -> Optional[AgentSettings]:
    """`rollout.multi_turn.*` as the agent loop's settings (None when off); the response budget over
    all turns is the rollout's response length; the tool turns are rendered with the prompt's
    `data.apply_chat_template_kwargs`."""
    if not multi_turn.enable:
        return None
    return AgentSettings(max_turns=int(multi_turn.max_turns), max_response_length=int(response_length),
                         tool_timeout_s=float(multi_turn.tool_timeout_s),
                         max_parallel_calls=int(multi_turn.max_parallel_calls),
                         max_tool_response_chars=int(multi_turn.max_tool_response_chars),
                         tool_response_truncate_side=str(multi_turn.tool_response_truncate_side),
                         format=str(multi_turn.format), tools=tuple(str(t) for t in multi_turn.tools),
                         wait_for_tools=bool(multi_turn.wait_for_tools),
                         chat_template_kwargs=(OmegaConf.to_container(chat_template_kwargs, resolve=True)
                                               if chat_template_kwargs else None))
