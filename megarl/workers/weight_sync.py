"""Baseline trainer -> rollout weight sync for a rollout that holds whole tensors (rollout TP = 1).

Every rank gathers the Megatron shards of DP replica 0 from all TP/PP ranks and rebuilds the HF
state dict through the model spec's weight map. It moves more bytes than needed when the
training layout is wider than one rank; `megarl.hybrid` plans the minimal transfers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megarl.models.weight_map import megatron_to_hf_state_dict


def gather_hf_weights(engine: Any) -> dict[str, torch.Tensor]:
    """The full HF-named state dict of `engine`'s model, on every rank of its world."""
    ranks = engine.ranks
    local = {name: t.detach().float().cpu().clone() for name, t in engine.get_named_weights()} if ranks.dp_rank == 0 else {}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return megatron_to_hf_state_dict([[local]], engine.spec)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ranks.dp_rank, ranks.pp_rank, ranks.tp_rank, local))
    shards: list[list[Any]] = [[None] * ranks.tp_size for _ in range(ranks.pp_size)]
    for dp_rank, pp_rank, tp_rank, state in gathered:
        if dp_rank == 0:
            shards[pp_rank][tp_rank] = state
    dtype = next(engine.model.parameters()).dtype
    return {k: v.to(dtype) for k, v in megatron_to_hf_state_dict(shards, engine.spec).items()}
