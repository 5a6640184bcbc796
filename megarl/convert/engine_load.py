"""Load model weights from a Megatron distributed checkpoint into a running engine, at any layout.

A converted checkpoint holds model weights only (no optimizer state), so the engine's own
`load_checkpoint` (model + optimizer + schedule) does not apply; this loads just the model's
sharded tensors through `megatron.core.dist_checkpointing` (which reshards on read) and refreshes
the optimizer's fp32 main parameters. Works on engine (trainer) checkpoints too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megarl.convert.dcp_io import MARKER_NAME, not_a_checkpoint
from megarl.errors import CheckpointError


def load_converted_weights(engine: Any, path: str | Path) -> None:
    """Collective (every rank of the engine calls it). `engine` is a `MegatronEngine`."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megarl.megatron.model import unwrap

    path = Path(path)
    if not (path / MARKER_NAME).is_file():
        raise CheckpointError(not_a_checkpoint(path))
    info = (dist_checkpointing.load_common_state_dict(str(path)) or {}).get("megarl") or {}
    if info.get("family") not in (None, engine.spec.family):
        raise CheckpointError(f"{path}: saved for family {info['family']}, the engine's model is {engine.spec.family}")
    saved_role = info.get("role", "policy")
    model = unwrap(engine.ddp)
    sharded = model.sharded_state_dict()
    # `_extra_state` objects (empty for the local spec) are not part of a converted checkpoint.
    wanted = {k: v for k, v in sharded.items() if not isinstance(v, ShardedObject)}
    optional: set[str] = set()
    if engine.role != "policy" and saved_role == "policy":
        optional = {k for k in wanted if k.startswith("output_layer.")}  # a critic from a policy: no head yet
    for k in optional:
        wanted.pop(k)
    stored = set(dist_checkpointing.load_tensors_metadata(str(path)))
    absent = sorted({getattr(v, "key", k) for k, v in wanted.items()} - stored)
    if absent:
        raise CheckpointError(f"{path}: checkpoint lacks tensors {absent[:5]} that the {engine.role} model needs")
    loaded = dist_checkpointing.load(wanted, str(path))
    result = model.load_state_dict({k: v for k, v in loaded.items() if k in wanted}, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state") and k not in optional]
    if missing:
        raise CheckpointError(f"{path}: no weights for {missing[:5]}")
    engine.optimizer.reload_model_params()
