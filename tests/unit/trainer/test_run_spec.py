"""The experiment resolved into typed role specs: every key lands in the field that does its job."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from megarl.config import load_config
from megarl.layout import ParallelLayout
from megarl.trainer.run_spec import resolve_run_spec, with_seed
from megarl.workers.losses import ActorLossSpec, CriticLossSpec
from megarl.workers.specs import OffloadSpec

pytestmark = pytest.mark.unit

MODEL = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 4, "intermediate_size": 128, "vocab_size": 64, "max_position_embeddings": 128}
BASE = {
    "data": {"train_files": ["train.parquet"], "val_files": ["val.parquet"], "train_batch_size": 8,
             "max_prompt_length": 32, "max_response_length": 16},
    "model": {"hf_config": MODEL},
    "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2,
              "megatron": {"tensor_model_parallel_size": 2}},
    "rollout": {"n": 4},
    "resources": {"actor_pool": {"nnodes": 1, "devices_per_node": 2}},
}


# Micro-batches by tokens: BASE's sequence count goes (back to its default), as nothing reads it then.
DYNAMIC = ("actor.use_dynamic_bsz=true", "actor.ppo_micro_batch_size_per_gpu=4")


def resolve(tmp_path: Path, *overrides: str, total_steps: int = 10):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(BASE))
    cfg = load_config(path, list(overrides))
    return resolve_run_spec(cfg, "/models/initial", pad_token_id=7, eos_token_ids=[3], total_steps=total_steps)


def test_actor_engine_settings_come_from_their_keys(tmp_path: Path) -> None:
    spec = resolve(tmp_path, "actor.optim.lr=3e-5", "actor.optim.lr_scheduler=linear", "actor.optim.min_lr=1e-6",
                   "actor.optim.lr_warmup_steps_ratio=0.2", "actor.log_prob_micro_batch_size_per_gpu=6",
                   "actor.megatron.sequence_parallel=true", "model.enable_gradient_checkpointing=true",
                   "model.recompute_granularity=selective", "model.use_remove_padding=true", "model.dtype=bf16",
                   "model.spec=qwen2")
    engine = spec.actor.engine
    # The schedule counts trainer steps (10, warmup 0.2 of them: 2); the engine advances it at each of
    # the 8 / 4 = 2 optimizer steps of a trainer step.
    assert (engine.lr, engine.lr_schedule, engine.min_lr, engine.lr_warmup_steps) == (3e-5, "linear", 1e-6, 2 * 2)
    assert (engine.micro_batch_size, engine.log_prob_micro_batch_size) == (2, 6)
    assert engine.sequence_parallel and engine.recompute_granularity == "selective"
    assert engine.use_sequence_packing and engine.dtype == "bf16" and engine.torch_dtype == torch.bfloat16
    assert not engine.use_dynamic_bsz
    assert engine.total_training_steps == 10 * 2 and engine.role == "policy"
    assert spec.actor.layout == ParallelLayout(tp=2, pp=1, cp=1, ep=1, dp=0)
    assert spec.actor.family == "qwen2" and spec.actor.model_dir == "/models/initial"
    assert spec.actor.update.mini_batch_sequences == 4 * 4  # prompts x rollout.n
    assert spec.response_length == 16 and spec.actor.max_response_length == 16
    # By tokens: the budget decides (the sequence counts, unread then, are refused beside it).
    engine = resolve(tmp_path, *DYNAMIC, "actor.ppo_max_token_len_per_gpu=96").actor.engine
    assert engine.use_dynamic_bsz and engine.max_token_len_per_micro_batch == 96


def test_lr_schedule_spans_the_run_in_optimizer_steps(tmp_path: Path) -> None:
    """A decaying schedule must reach min_lr at the run's end, not after 1/k of it: k optimizer steps
    a trainer step, ppo_epochs x train_batch_size / ppo_mini_batch_size of them, per trained role."""
    spec = resolve(tmp_path, "actor.ppo_mini_batch_size=2", "actor.ppo_epochs=3", "actor.optim.lr_warmup_steps=1",
                   "critic.enable=true", "critic.ppo_mini_batch_size=8", "critic.ppo_epochs=2",
                   "critic.optim.total_training_steps=7", "critic.optim.lr_warmup_steps_ratio=0.3",
                   "critic.ppo_micro_batch_size_per_gpu=2", total_steps=10)
    actor, critic = spec.actor.engine, spec.critic.engine
    assert (actor.total_training_steps, actor.lr_warmup_steps) == (10 * 3 * 4, 1 * 3 * 4)
    # an explicit schedule length (7 trainer steps) and its warmup ratio: int(0.3 x 7) = 2 trainer steps
    assert (critic.total_training_steps, critic.lr_warmup_steps) == (7 * 2 * 1, 2 * 2 * 1)


def test_defaults_leave_optional_features_off(tmp_path: Path) -> None:
    engine = resolve(tmp_path).actor.engine
    assert engine.log_prob_micro_batch_size == engine.micro_batch_size == 2  # null: the PPO micro-batch
    assert engine.recompute_granularity is None and not engine.sequence_parallel and not engine.use_sequence_packing
    assert engine.lr_schedule == "constant"


def test_only_trained_roles_sum_gradients_through_shared_memory(tmp_path: Path) -> None:
    spec = resolve(tmp_path, "algorithm.adv_estimator=gae", "actor.use_kl_loss=true")
    assert spec.actor.engine.host_grad_reduce and spec.critic.engine.host_grad_reduce
    assert not spec.ref.engine.host_grad_reduce  # frozen: it never sums gradients
    spec = resolve(tmp_path, "algorithm.adv_estimator=gae", "resources.cpu_grad_reduce=gloo")
    assert not spec.actor.engine.host_grad_reduce and not spec.critic.engine.host_grad_reduce


def test_actor_loss_spec_takes_clip_ratio_when_low_and_high_are_null(tmp_path: Path) -> None:
    loss = resolve(tmp_path, "actor.clip_ratio=0.3", "actor.clip_ratio_high=0.28", "actor.use_kl_loss=true",
                   "actor.kl_loss_coef=0.05", "actor.entropy_coeff=0.01", "actor.policy_loss.loss_mode=gspo").actor.loss
    assert loss == ActorLossSpec(loss_mode="gspo", clip_ratio_low=0.3, clip_ratio_high=0.28, clip_ratio_c=3.0,
                                 loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05,
                                 kl_loss_type="low_var_kl")


def test_critic_from_its_own_checkpoint_with_its_own_offload(tmp_path: Path) -> None:
    spec = resolve(tmp_path, "algorithm.adv_estimator=gae", "critic.model_path=/models/rm", "critic.param_offload=true",
                   "critic.optim.lr=2e-5", "critic.ppo_micro_batch_size_per_gpu=4", "critic.cliprange_value=0.2")
    critic = spec.critic
    assert critic.model_dir == "/models/rm" and critic.engine.role == "value" and critic.engine.lr == 2e-5
    assert critic.offload == OffloadSpec(params=True, grads=True, optimizer=False)
    assert critic.loss == CriticLossSpec(cliprange_value=0.2, loss_agg_mode="token-mean")
    assert critic.engine.micro_batch_size == 4 and critic.layout == spec.actor.layout
    assert spec.ref is None  # no KL term: no reference


def test_reference_only_with_a_kl_term(tmp_path: Path) -> None:
    spec = resolve(tmp_path, "actor.use_kl_loss=true", "ref.log_prob_micro_batch_size_per_gpu=5", "ref.param_offload=true",
                   "actor.param_offload=true", "actor.optimizer_offload=true")
    assert spec.ref.engine.micro_batch_size == spec.ref.engine.log_prob_micro_batch_size == 5
    assert spec.ref.offload == OffloadSpec(params=True) and spec.ref.update is None and spec.ref.loss is None
    assert spec.actor.offload == OffloadSpec(params=True, grads=False, optimizer=True)
    assert spec.critic is None


def test_frozen_roles_are_built_untrained_and_the_trained_ones_trained(tmp_path: Path) -> None:
    spec = resolve(tmp_path, "algorithm.adv_estimator=gae", "actor.use_kl_loss=true")
    assert spec.actor.engine.trained and spec.critic.engine.trained
    assert not spec.ref.engine.trained  # no DDP, optimizer or schedule in the engine


def test_reference_log_probs_are_micro_batched_like_the_actors(tmp_path: Path) -> None:
    """verl's ref.log_prob_use_dynamic_bsz defaults to the actor's use_dynamic_bsz: under it the
    reference splits its pass by the actor's token budget, as the actor's log-prob pass does."""
    # (ref.log_prob_micro_batch_size_per_gpu, which this pass would not read, is refused beside it.)
    spec = resolve(tmp_path, "actor.use_kl_loss=true", *DYNAMIC, "actor.ppo_max_token_len_per_gpu=96")
    ref, actor = spec.ref.engine, spec.actor.engine
    assert ref.use_dynamic_bsz and ref.max_token_len_per_micro_batch == actor.max_token_len_per_micro_batch == 96
    spec = resolve(tmp_path, "actor.use_kl_loss=true", "ref.log_prob_micro_batch_size_per_gpu=5")
    assert not spec.ref.engine.use_dynamic_bsz and spec.ref.engine.forward_micro_batch_size == 5


def test_rollout_options_and_sampling(tmp_path: Path) -> None:
    spec = resolve(tmp_path, "rollout.temperature=0.9", "rollout.top_p=0.95", "rollout.top_k=20", "rollout.max_num_seqs=32",
                   "rollout.tensor_model_parallel_size=2", "rollout.free_cache_engine=false", "rollout.calculate_log_probs=false",
                   "rollout.update_weights_bucket_mb=64", "rollout.dtype=fp16", "rollout.logprobs_mode=raw", "rollout.sleep_level=1",
                   "rollout.val_kwargs.n=3", "rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=0.6",
                   "rollout.sync_verify_freq=3")
    ro = spec.rollout
    assert (ro.options.pad_token_id, ro.options.eos_token_ids, ro.options.dtype) == (7, (3,), "float16")
    assert (ro.options.tensor_parallel_size, ro.options.max_model_len, ro.options.max_num_seqs) == (2, 48, 32)
    assert ro.options.logprobs_mode == "raw" and not ro.options.enable_sleep_mode and ro.options.sleep_level == 1
    assert not ro.free_cache_engine and not ro.calculate_log_probs and ro.sync_bucket_bytes == 64 * 2**20
    assert ro.sync_verify_freq == 3 and resolve(tmp_path).rollout.sync_verify_freq == 1  # on by default
    train = spec.train_sampling
    assert (train.n, train.temperature, train.top_p, train.top_k, train.max_new_tokens, train.greedy) == (4, 0.9, 0.95, 20, 16, False)
    val = spec.val_sampling
    assert (val.n, val.temperature, val.greedy, val.max_new_tokens) == (3, 0.6, False, 16)
    assert with_seed(train, 11).seed == 11 and train.seed is None
    greedy = resolve(tmp_path).val_sampling
    assert greedy.greedy and greedy.n == 1
    assert not train.ignore_eos and not greedy.ignore_eos
    full = resolve(tmp_path, "rollout.ignore_eos=true")
    assert full.train_sampling.ignore_eos and full.val_sampling.ignore_eos
