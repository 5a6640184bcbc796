"""The base class of every SPMD worker process: its place in the world and its parallel groups.

A `WorkerGroup` starts one Ray actor per rank and passes each a `WorkerContext` (role, rank, world
size, local rank, rendezvous address). `Worker.__init__` exports these as the usual torchrun
environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so code written
for torchrun runs unchanged inside the actor.

Parallel groups are created by `init_distributed`, which the driver calls explicitly through
`WorkerGroup.init_distributed`. With a `layout` it hands over to the Megatron engine
(`megarl.megatron.parallel.init_distributed`); without one it creates a plain data-parallel world.
Subclasses may override it (and must then return their `megarl.layout.RankCoord`): that is the
hook through which an engine plugs its own groups in. Dispatch reads the `RankCoord` of every rank.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from megarl.layout import ParallelLayout, RankCoord


@dataclass(frozen=True)
class WorkerContext:
    """Where one rank of a role sits. Built by the WorkerGroup, passed to the worker's constructor."""

    role: str
    rank: int
    world_size: int
    local_rank: int  # index of this rank's device on its node (0 .. local_world_size-1)
    local_world_size: int  # devices per node in the pool
    node_index: int  # which of the pool's nodes (placement groups) this rank is on
    master_addr: str  # rank 0's node IP
    master_port: int  # a port that was free on rank 0's node when the group was created
    device: str = "cpu"  # "cpu" or "cuda"

    def env_vars(self) -> dict[str, str]:
        """The torchrun-style environment this rank runs under."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "MEGARL_ROLE": self.role,
        }


def visible_device_index(local_rank: str | int, device_count: int) -> int:
    """The CUDA device a rank with node-local rank `local_rank` uses among the `device_count` it
    sees: `local_rank` modulo their number. A Ray worker given one GPU sees it as cuda:0 whatever its
    place on the node; a process that sees the whole node takes its own."""
    return int(local_rank) % max(1, device_count)

@dataclass(frozen=True)
class NodeInfo:
    """Where a worker process actually runs (reported by the worker itself)."""

    node_id: str
    ip: str
    hostname: str
    pid: int


class Worker:
    """Base class of megarl's Ray workers. Subclasses take `context` first and pass it up.

    Example::

        class CriticWorker(Worker):
            def __init__(self, context: WorkerContext, config: CriticConfig) -> None:
                super().__init__(context)
                ...
    """

    def __init__(self, context: WorkerContext) -> None:
        self.context = context
        os.environ.update(context.env_vars())
        self._rank_coord = RankCoord.data_parallel_only(context.rank, context.world_size)

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    def node_info(self) -> NodeInfo:
        """Node id, IP, host name and process id of this worker."""
        import ray

        return NodeInfo(
            node_id=ray.get_runtime_context().get_node_id(),
            ip=ray.util.get_node_ip_address(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
        )

    def init_distributed(
        self,
        backend: str | None = None,
        layout: Any = None,
        timeout_minutes: int = 10,
    ) -> RankCoord:
        """Create this rank's process groups and return its coordinates in them.

        backend: "gloo" or "nccl"; default nccl when the context's device is CUDA, gloo otherwise.
        layout: None for a plain data-parallel world (only the default process group), or a
        `megarl.layout.ParallelLayout` (or a dict of its fields) to create Megatron's
        TP/PP/DP/CP/EP groups through the engine.
        """
        backend = backend or ("nccl" if self.context.device == "cuda" else "gloo")
        if layout is None:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group(
                    backend=backend,
                    init_method=f"tcp://{self.context.master_addr}:{self.context.master_port}",
                    rank=self.rank,
                    world_size=self.world_size,
                    timeout=timedelta(minutes=timeout_minutes),
                )
            self._rank_coord = RankCoord.data_parallel_only(self.rank, self.world_size)
            return self._rank_coord
        return self._init_megatron(backend, layout, timeout_minutes)

    def _init_megatron(self, backend: str, layout: Any, timeout_minutes: int) -> RankCoord:
        # Imported here: torch and Megatron cost seconds and plain data-parallel workers never need them.
        from megarl.megatron.parallel import current_ranks, init_distributed

        if isinstance(layout, dict):
            layout = ParallelLayout(**layout)
        init_distributed(
            rank=self.rank,
            world_size=self.world_size,
            master_addr=self.context.master_addr,
            master_port=self.context.master_port,
            layout=layout,
            backend=backend,
            timeout_minutes=timeout_minutes,
            local_rank=self.context.local_rank,
        )
        self._rank_coord = current_ranks()
        return self._rank_coord

    def set_rank_coord(self, info: RankCoord) -> None:
        """For engines that build their groups themselves: record this rank's coordinates."""
        if info.rank != self.rank:
            raise ValueError(f"rank coordinates for rank {info.rank} given to rank {self.rank}")
        self._rank_coord = info

    def rank_coord(self) -> RankCoord:
        """This rank's coordinates (data-parallel only until `init_distributed` says otherwise)."""
        return self._rank_coord

    def destroy_distributed(self) -> None:
        """Tear down the process groups (Megatron's too, when they exist). Safe to call twice."""
        import torch.distributed as dist

        # Only when Megatron is already loaded: importing it costs seconds and nothing needs it.
        parallel_state = sys.modules.get("megatron.core.parallel_state")
        if parallel_state is not None and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
