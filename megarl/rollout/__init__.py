"""megarl.rollout: generate responses with vLLM (GPU or the CPU build) or HF transformers.

``create_rollout_engine(rollout.engine, model_dir, EngineOptions(...))`` gives a
:class:`RolloutEngine`; ``engine.generate(prompt_batch, SamplingParams(...))`` returns the rollout
batch (columns in :mod:`megarl.rollout.output`); ``update_weights`` / ``sleep`` / ``wake_up`` /
``release`` manage it between training steps.
"""

from megarl.rollout.base import (
    EngineOptions,
    EngineState,
    RolloutEngine,
    RolloutStateError,
    SamplingParams,
    WeightUpdateError,
)
from megarl.rollout.factory import create_rollout_engine, resolve_engine_name

__all__ = [
    "EngineOptions",
    "EngineState",
    "RolloutEngine",
    "RolloutStateError",
    "SamplingParams",
    "WeightUpdateError",
    "create_rollout_engine",
    "resolve_engine_name",
]
