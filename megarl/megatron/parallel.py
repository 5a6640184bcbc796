"""Process groups for 4D (+expert) parallel training: TP, PP, DP, CP, EP (and expert TP) over one world.

`init_distributed` creates the groups of a `megarl.layout.ParallelLayout`; `current_ranks` reads
this process's `megarl.layout.RankCoord` back from Megatron's `parallel_state`.

The same call works under torchrun (rank/world/address from the environment) and inside Ray actors
(everything passed explicitly). Backend: gloo without CUDA, NCCL with it.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.cluster.worker import visible_device_index
from megarl.layout import ParallelLayout, RankCoord
from megarl.megatron.cpu_compat import apply_cpu_compat


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    layout: ParallelLayout = ParallelLayout(),
    backend: str | None = None,
    timeout_minutes: int = 10,
    local_rank: int | None = None,
) -> ParallelLayout:
    """Create the default process group and Megatron's TP/PP/DP/CP/EP groups.

    Arguments left as None come from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, LOCAL_RANK). Returns the layout with `dp` resolved.
    """
    from megatron.core import parallel_state

    apply_cpu_compat()
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    master_port = int(master_port or os.environ.get("MASTER_PORT", "29500"))
    backend = backend or default_backend()
    resolved = layout.resolved(world_size)

    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
        torch.cuda.set_device(visible_device_index(local, torch.cuda.device_count()))
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=timeout_minutes),
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=resolved.tp,
        pipeline_model_parallel_size=resolved.pp,
        context_parallel_size=resolved.cp,
        expert_model_parallel_size=resolved.ep,
        expert_tensor_parallel_size=resolved.etp,
        distributed_timeout_minutes=timeout_minutes,
    )
    return resolved


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def current_ranks() -> RankCoord:
    """This process's coordinates, as Megatron's groups (created by `init_distributed`) say."""
    from megatron.core import parallel_state as ps

    return RankCoord(
        rank=dist.get_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        edp_rank=ps.get_expert_data_parallel_rank(),
        edp_size=ps.get_expert_data_parallel_world_size(),
    )
