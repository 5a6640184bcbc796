"""What each worker role receives: typed specs, resolved once on the driver from the experiment.

`megarl.trainer.run_spec.resolve_run_spec` is the one place that reads the experiment config and
builds these; roles never see the config itself. Each field has one meaning and one unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from megarl.agent.loop import AgentSettings
from megarl.layout import ParallelLayout
from megarl.megatron.optim import EngineConfig
from megarl.rollout.base import EngineOptions
from megarl.rollout.partial import PartialRollout
from megarl.workers.losses import ActorLossSpec, CriticLossSpec


@dataclass(frozen=True)
class OffloadSpec:
    """What a training role moves to host memory between the phases that use it.

    `params`: parameters (and the DDP grad buffer they share storage with when `grads` too);
    `grads`: gradient buffers; `optimizer`: the (distributed) optimizer state.
    """

    params: bool = False
    grads: bool = False
    optimizer: bool = False

    @property
    def any(self) -> bool:
        return self.params or self.grads or self.optimizer


@dataclass(frozen=True)
class UpdateSpec:
    """The PPO update loop of a trained role.

    `mini_batch_sequences`: sequences per optimizer step over all DP ranks (prompts x rollout.n);
    each DP rank takes `mini_batch_sequences / dp` of them.
    """

    mini_batch_sequences: int
    epochs: int = 1
    shuffle: bool = False


@dataclass(frozen=True)
class EngineRoleSpec:
    """A role that runs the Megatron engine: actor, reference, critic, reward model.

    `model_dir`: the HF directory its initial weights come from; `temperature`: logits are divided
    by it before log-probs (the rollout's sampling temperature); `max_response_length`: the
    response length R the loss normalisers use; `update`/`loss`: None for a frozen role.
    """

    name: str
    model_dir: str
    layout: ParallelLayout
    engine: EngineConfig
    offload: OffloadSpec = OffloadSpec()
    temperature: float = 1.0
    max_response_length: int = 1
    update: Optional[UpdateSpec] = None
    loss: Union[ActorLossSpec, CriticLossSpec, None] = None
    # The model family in model_specs/ (None: detected from config.json's model_type).
    family: Optional[str] = None


@dataclass(frozen=True)
class RolloutSpec:
    """The rollout engine of each rank of the hybrid actor.

    `engine`: auto | vllm | hf; `free_cache_engine`: the engine sleeps (KV cache and weight copy
    released) while the training roles work; `sync_bucket_bytes`: size of one weight-sync bucket;
    `calculate_log_probs`: keep the sampled tokens' log-probs (`rollout_log_probs`).
    `multi_turn`: the agent loop's limits and tools, when responses alternate with tool calls.
    """

    model_dir: str
    engine: str
    options: EngineOptions
    tensor_parallel_size: int = 1
    free_cache_engine: bool = True
    sync_bucket_bytes: int = 512 * 2**20
    sync_verify_freq: int = 1  # verify every k-th weight sync (0: never)
    calculate_log_probs: bool = True
    multi_turn: Optional[AgentSettings] = None  # set: multi-turn rollouts with tools (megarl.agent)
    partial: Optional[PartialRollout] = None  # set: generation in chunks that new weights interrupt
