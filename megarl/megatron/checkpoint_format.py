"""The version of the engine's checkpoint format and the optimizer kinds it is saved with, in a module
of their own: the driver checks them before a resume (megarl.trainer.checkpoint_verify) without
importing Megatron-Core."""

from __future__ import annotations

from typing import Any, Optional

FORMAT_VERSION = 2  # 2: one optimizer entry per distributed optimizer (dense, experts)

# The kinds of optimizer an engine checkpoint is saved with (megarl.megatron.checkpoint records one as
# `optimizer_kind`), and the optimizer state holding each one's fp32 main parameters
# (`optimizer.state.<name>.<model key>`; None: the model's own parameters are the main parameters).
DISTRIBUTED, PLAIN_FP32, PLAIN_FLOAT16 = "distributed", "plain_fp32", "plain_float16"
OPTIMIZER_KINDS = {
    DISTRIBUTED: "the distributed optimizer (use_distributed_optimizer=true)",
    PLAIN_FP32: "the plain fp32 optimizer (use_distributed_optimizer=false, fp32)",
    PLAIN_FLOAT16: "the plain bf16 optimizer (use_distributed_optimizer=false, bf16 with fp32 main parameters)",
}
MAIN_PARAM_STATE = {DISTRIBUTED: "param", PLAIN_FP32: None, PLAIN_FLOAT16: "fp32_param"}


def saved_optimizer_kind(common: dict[str, Any]) -> Optional[str]:
    """The optimizer kind of an engine checkpoint from its `common.pt`: as recorded, or (saved before
    megarl recorded it) from the shape of Megatron's common optimizer state; None when neither tells."""
    recorded = (common.get("megarl") or {}).get("optimizer_kind")
    if recorded is not None:
        return recorded
    part = (common.get("optimizer") or {}).get("part0")
    if not isinstance(part, dict):
        return None
    if "param_state_sharding_type" in part:  # DistributedOptimizer, fully reshardable
        return DISTRIBUTED
    if "optimizer" in part:  # Float16OptimizerWithFloat16Params: {"optimizer": torch state, ...}
        return PLAIN_FLOAT16
    if "param_groups" in part:  # FP32Optimizer: torch's state dict itself
        return PLAIN_FP32
    return None


def configured_optimizer_kind(use_distributed_optimizer: bool, dtype: str) -> str:
    """The kind of optimizer `optim.build_optimizer` makes for these settings (dtype "fp32" or "bf16")."""
    if use_distributed_optimizer:
        return DISTRIBUTED
    return PLAIN_FP32 if dtype in ("fp32", "float32") else PLAIN_FLOAT16
