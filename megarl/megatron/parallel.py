"""Process groups for 4D (+expert) parallel training: TP, PP, DP, CP, EP over one world.

The same call works under torchrun (rank/world/address from the environment) and inside Ray actors
(everything passed explicitly). Backend: gloo without CUDA, NCCL with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.errors import ConfigError
from megarl.megatron.cpu_compat import apply_cpu_compat


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of parallelism. `dp` is derived from the world size when left at 0."""

    tp: int = 1
    pp: int = 1
    dp: int = 0
    cp: int = 1
    ep: int = 1

    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def resolved(self, world_size: int) -> "ParallelLayout":
        """This layout with `dp` filled in and checked against `world_size`."""
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel layout: {name}={getattr(self, name)} must be >= 1")
        mp = self.model_parallel_size()
        if world_size % mp != 0:
            raise ConfigError(
                f"parallel layout: world size {world_size} is not divisible by "
                f"tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {mp}"
            )
        dp = world_size // mp
        if self.dp not in (0, dp):
            raise ConfigError(
                f"parallel layout: dp={self.dp} but world size {world_size} / (tp*pp*cp={mp}) = {dp}"
            )
        if (dp * self.cp) % self.ep != 0:
            raise ConfigError(f"parallel layout: ep={self.ep} must divide dp*cp={dp * self.cp}")
        return ParallelLayout(tp=self.tp, pp=self.pp, dp=dp, cp=self.cp, ep=self.ep)


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
        torch.cuda.set_device(local % torch.cuda.device_count())
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


@dataclass(frozen=True)
class ParallelRanks:
    """This process's coordinates in the layout."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    ep_rank: int = 0
    ep_size: int = 1


def current_ranks() -> ParallelRanks:
    from megatron.core import parallel_state as ps

    return ParallelRanks(
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
    )
