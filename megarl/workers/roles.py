"""The role objects hosted in SPMD worker processes: actor, reference, rollout, critic.

A `megarl.cluster.host_worker.HostWorker` builds them as `RoleClass(context, **kwargs)` and the
driver reaches them through `WorkerGroup.for_role(name)`. The hybrid actor process holds
"actor", "ref" and "rollout" together, so the rollout engine takes its weights from the actor's
engine in the same process (`RolloutRole.sync_weights`).

Every rank runs every call (SPMD). Data-parallel calls receive this rank's DP shard.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from megarl.protocol import Batch

logger = logging.getLogger(__name__)


def engine_config(cfg: DictConfig, section: str, role: str, total_steps: int) -> dict[str, Any]:
    """The `MegatronEngine` settings of `section` ("actor", "critic" or "ref") of the experiment."""
    sec = cfg[section]
    optim = sec.get("optim") or cfg.actor.optim
    warmup = optim.lr_warmup_steps or int(optim.lr_warmup_steps_ratio * total_steps)
    micro = sec.get("ppo_micro_batch_size_per_gpu") or sec.get("log_prob_micro_batch_size_per_gpu") or 1
    return {
        "role": role,
        "dtype": cfg.model.dtype,
        "seed": int(cfg.trainer.seed),
        "lr": float(optim.lr),
        "min_lr": float(optim.min_lr),
        "betas": tuple(optim.betas),
        "eps": float(optim.eps),
        "weight_decay": float(optim.weight_decay),
        "clip_grad": float(optim.clip_grad),
        "lr_schedule": "cosine" if optim.lr_scheduler == "cosine" else "constant",
        "lr_warmup_steps": int(warmup),
        "total_training_steps": int(optim.total_training_steps or max(1, total_steps)),
        "micro_batch_size": int(micro),
        "use_dynamic_bsz": bool(sec.get("use_dynamic_bsz", False)),
        "max_token_len_per_micro_batch": int(sec.get("ppo_max_token_len_per_gpu", 16384)),
        "use_distributed_optimizer": bool(optim.use_distributed_optimizer),
    }


def _layout(par: Any) -> Any:
    from megarl.megatron.parallel import ParallelLayout

    return ParallelLayout(
        tp=par.tensor_model_parallel_size,
        pp=par.pipeline_model_parallel_size,
        cp=par.context_parallel_size,
        ep=par.expert_model_parallel_size,
    )


def _mean(values: Any) -> float:
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    return float(sum(values) / max(1, len(values)))


class _EngineRole:
    """Shared plumbing: config, model directory, engine construction, offload and checkpoints."""

    section = "actor"
    engine_role = "policy"

    def __init__(self, context: Any, config: dict, model_dir: str, total_steps: int = 1) -> None:
        self.context = context
        self.cfg = OmegaConf.create(config)
        self.model_dir = model_dir
        self.total_steps = total_steps
        self.engine: Any = None

    def init_model(self) -> None:
        """Build the Megatron engine on this rank's groups and load the model directory's weights."""
        from megarl.megatron.engine import MegatronEngine
        from megarl.models.spec import ModelSpec

        spec = ModelSpec.from_hf_config(self.model_dir)
        from megarl.config.validate import role_parallel

        layout = _layout(role_parallel(self.cfg, self.section))
        self.engine = MegatronEngine(spec, layout, engine_config(self.cfg, self.section, self.engine_role, self.total_steps))
        self.engine.load_hf_weights(self.model_dir)

    def offload(self) -> None:
        if self.engine is not None and self.engine.offloaded is None:
            self.engine.offload_to_cpu()

    def onload(self) -> None:
        if self.engine is not None:
            self.engine.onload()

    def save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(path)

    def _train(self, batch: Batch, loss_fn: Any, **kwargs: Any) -> dict[str, float]:
        """PPO epochs over mini-batches of this rank's shard; metrics averaged over optimizer steps."""
        from megarl.trainer.setup import resolve_response_length

        sec = self.cfg[self.section]
        mini = sec.ppo_mini_batch_size * self.cfg.rollout.n // self.engine.ranks.dp_size
        history = self.engine.train_step(
            batch, loss_fn, mini_batch_size=mini, epochs=sec.ppo_epochs, shuffle=sec.shuffle,
            max_response_len=resolve_response_length(self.cfg), **kwargs,
        )
        return {k if "/" in k else f"{self.section}/{k}": _mean(v) for k, v in history.items()}


class ActorRole(_EngineRole):
    """The policy being trained."""

    def compute_log_prob(self, batch: Batch) -> Batch:
        """`old_log_probs` and `entropys` (B, R) under the current weights, at the rollout temperature."""
        out = self.engine.compute_log_prob(batch, temperature=float(self.cfg.rollout.temperature), calculate_entropy=True)
        return Batch.from_dict({"old_log_probs": out["log_probs"], "entropys": out["entropys"]})

    def update_actor(self, batch: Batch) -> dict[str, float]:
        from megarl.workers.losses import make_actor_loss

        return self._train(batch, make_actor_loss(self.cfg.actor),
                           temperature=float(self.cfg.rollout.temperature), calculate_entropy=True)

    def named_weights(self) -> Any:
        return self.engine.get_named_weights()


class RefRole(_EngineRole):
    """The frozen reference policy (KL loss or KL-in-reward)."""

    section = "ref"

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        out = self.engine.compute_log_prob(batch, temperature=float(self.cfg.rollout.temperature))
        return Batch.from_dict({"ref_log_prob": out["log_probs"]})

    def save_checkpoint(self, path: str) -> None:  # frozen: rebuilt from the initial weights on resume
        return None

    def load_checkpoint(self, path: str) -> None:
        return None


class CriticRole(_EngineRole):
    """The value model: same trunk as the policy, a scalar head."""

    section = "critic"
    engine_role = "value"

    def compute_values(self, batch: Batch) -> Batch:
        return Batch.from_dict({"values": self.engine.compute_values(batch)})

    def update_critic(self, batch: Batch) -> dict[str, float]:
        from megarl.workers.losses import make_critic_loss

        return self._train(batch, make_critic_loss(self.cfg.critic))


class RolloutRole:
    """The rollout engine of this rank, refilled from the actor's weights in the same process."""

    def __init__(self, context: Any, config: dict, model_dir: str, pad_token_id: int, eos_token_ids: list[int]) -> None:
        self.context = context
        self.cfg = OmegaConf.create(config)
        self.model_dir = model_dir
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.engine: Any = None
        self.actor: Any = None
        self.weight_sync: Any = None
        self.weights_version = -1

    def connect_roles(self, roles: dict[str, Any]) -> None:
        self.actor = roles.get("actor")

    def init_engine(self) -> str:
        """Build the engine (vLLM or HF, per `rollout.engine`); returns which and why."""
        from megarl.rollout.base import EngineOptions
        from megarl.rollout.factory import create_rollout_engine

        ro = self.cfg.rollout
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[ro.dtype or self.cfg.model.dtype]
        options = EngineOptions(
            pad_token_id=self.pad_token_id,
            eos_token_ids=tuple(self.eos_token_ids),
            dtype=dtype,
            seed=int(self.cfg.trainer.seed) * 1000 + self.context.rank,
            tensor_parallel_size=int(ro.tensor_model_parallel_size),
            max_model_len=int(self.cfg.data.max_prompt_length + (ro.response_length or self.cfg.data.max_response_length)),
            max_num_seqs=int(ro.max_num_seqs),
            kv_cache_memory_gb=float(ro.kv_cache_memory_gb),
            gpu_memory_utilization=float(ro.gpu_memory_utilization),
            enforce_eager=bool(ro.enforce_eager),
            logprobs_mode=str(ro.logprobs_mode),
        )
        self.engine = create_rollout_engine(ro.engine, self.model_dir, options)
        return f"{self.engine.name} ({self.engine.selection_reason})"

    def sync_weights(self, version: int) -> dict[str, float]:
        """Reshard the actor's current weights into the rollout engine (every rank calls this).

        The plan (built once) sends each rank only the bytes of its rollout shard it does not hold.
        """
        from megarl.hybrid.sync import WeightSync

        if self.weight_sync is None:
            self.weight_sync = WeightSync(
                self.actor.engine, self.engine, rollout_tp=int(self.cfg.rollout.tensor_model_parallel_size),
                bucket_bytes=int(self.cfg.rollout.update_weights_bucket_mb) * 2**20,
            )
        stats = self.weight_sync.sync()
        self.weights_version = version
        return {
            "sync/bytes_received": float(stats.bytes_received),
            "sync/bytes_minimum": float(stats.minimum_bytes),
            "sync/bytes_sent": float(stats.bytes_sent),
            "sync/seconds": float(stats.seconds),
        }

    def generate(self, prompts: Batch, sampling: dict[str, Any]) -> Batch:
        from megarl.rollout.base import SamplingParams

        params = SamplingParams(**sampling)
        return self.engine.generate(prompts, params)

    def sleep(self) -> None:
        if self.cfg.rollout.free_cache_engine and self.engine is not None:
            self.engine.sleep()

    def wake_up(self) -> None:
        if self.engine is not None and self.engine.state.value != "awake":
            self.engine.wake_up()


def set_torch_threads(n: int) -> int:
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()
