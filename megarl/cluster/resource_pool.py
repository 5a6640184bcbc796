"""Resource pools: N nodes x D devices reserved through Ray placement groups.

A pool reserves one placement group per node, each STRICT_PACK with D bundles (one per device).
Why not a single group with N*D bundles: STRICT_PACK would force everything onto one machine,
and PACK/SPREAD give no say in how many bundles share a node, so rank -> node would be
unpredictable and a tensor-parallel group could straddle machines. Per-node STRICT_PACK groups
guarantee that ranks [k*D, (k+1)*D) share a node (local ranks 0..D-1), which is what intra-node
tensor parallelism and LOCAL_RANK need. Two node groups may still share a machine that has room
for both; when D is the whole machine's device count they cannot.

A "device" is a GPU on CUDA machines (a bundle holds 1 GPU + `cpus_per_device` CPUs) and a slot
of `cpus_per_device` CPUs on a CPU machine. Several worker groups (roles) may share the pool's
bundles as separate processes: `max_colocate` says how many, and each actor then asks for
1/max_colocate of its bundle. Several roles in the *same* process use one `HostWorker` group.

`wait(timeout_s)` creates the groups and waits for them; if the cluster can never hold the pool
it fails at once, and if the resources stay busy it fails at the timeout, both with a message
that says what was asked and what Ray has, instead of hanging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from megarl.cluster.ray_cluster import (
    ClusterError,
    describe_cluster,
    register_for_cleanup,
    unregister_for_cleanup,
)
from megarl.errors import ConfigError

DEVICES = ("cpu", "cuda")


class PoolUnavailableError(ClusterError):
    """The cluster cannot (or not within the timeout) hold the resource pool."""


@dataclass(frozen=True)
class Placement:
    """Where one rank of a pool goes."""

    placement_group: PlacementGroup
    bundle_index: int
    node_index: int
    local_rank: int


class ResourcePool:
    """nnodes x devices_per_node devices, reserved on `wait()` and released on `shutdown()`."""

    def __init__(
        self,
        name: str,
        nnodes: int,
        devices_per_node: int,
        device: str = "cpu",
        cpus_per_device: float = 1.0,
        max_colocate: int = 1,
        extra_resources_per_device: dict[str, float] | None = None,
    ) -> None:
        for key, value in (("nnodes", nnodes), ("devices_per_node", devices_per_node), ("max_colocate", max_colocate)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"resource pool {name!r}: {key} must be a positive int, got {value!r}")
        if device not in DEVICES:
            raise ConfigError(f"resource pool {name!r}: device must be one of {DEVICES}, got {device!r}")
        if cpus_per_device <= 0:
            raise ConfigError(f"resource pool {name!r}: cpus_per_device must be > 0, got {cpus_per_device}")
        self.name = name
        self.nnodes = nnodes
        self.devices_per_node = devices_per_node
        self.device = device
        self.cpus_per_device = float(cpus_per_device)
        self.max_colocate = max_colocate
        self.extra_resources_per_device = dict(extra_resources_per_device or {})
        self._groups: list[PlacementGroup] = []
        self._ready = False
        self._roles: list[str] = []

    @property
    def world_size(self) -> int:
        return self.nnodes * self.devices_per_node

    def bundle(self) -> dict[str, float]:
        """Resources of one device's bundle."""
        resources = {"CPU": self.cpus_per_device, **self.extra_resources_per_device}
        if self.device == "cuda":
            resources["GPU"] = 1.0
        return resources

    def per_node(self) -> dict[str, float]:
        """Resources one node of the pool needs."""
        return {name: amount * self.devices_per_node for name, amount in self.bundle().items()}

    def describe_request(self) -> str:
        return (
            f"resource pool {self.name!r}: {self.nnodes} node(s) x {self.devices_per_node} {self.device} "
            f"device(s), each node needing {self.per_node()} on one machine"
        )

    def wait(self, timeout_s: float = 60.0) -> ResourcePool:
        """Reserve the pool (idempotent). PoolUnavailableError if it cannot be held in timeout_s."""
        if self._ready:
            return self
        if not self._groups:
            self._check_feasible()
            self._groups = [
                placement_group([self.bundle()] * self.devices_per_node, strategy="STRICT_PACK",
                                name=f"{self.name}-node{index}")
                for index in range(self.nnodes)
            ]
            register_for_cleanup(self)
        ready, _ = ray.wait([group.ready() for group in self._groups], num_returns=len(self._groups),
                            timeout=timeout_s)
        if len(ready) < len(self._groups):
            placed = len(ready)
            self.shutdown()
            raise PoolUnavailableError(
                f"{self.describe_request()}: only {placed} of {self.nnodes} node(s) could be reserved "
                f"within {timeout_s} s (the resources are held by other work or the nodes are missing).\n"
                f"Ray has:\n{describe_cluster()}"
            )
        self._ready = True
        return self

    def _check_feasible(self) -> None:
        """Fail at once if the alive nodes' *total* resources can never hold the pool."""
        need = self.per_node()
        fits = 0
        for node in ray.nodes():
            if not node["Alive"]:
                continue
            total = node["Resources"]
            fits += min(int(total.get(name, 0.0) / amount + 1e-9) for name, amount in need.items())
        if fits < self.nnodes:
            raise PoolUnavailableError(
                f"{self.describe_request()}: the cluster can never hold it (room for {fits} such node(s) "
                f"in total). Ask for fewer nodes or devices, or add nodes.\nRay has:\n{describe_cluster()}"
            )

    def placement(self, rank: int) -> Placement:
        """Placement group and bundle of `rank` (ranks fill node 0's devices first)."""
        if not self._ready:
            raise ClusterError(f"resource pool {self.name!r} is not reserved yet: call wait() first")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside pool {self.name!r} of world size {self.world_size}")
        node_index, local_rank = divmod(rank, self.devices_per_node)
        return Placement(self._groups[node_index], local_rank, node_index, local_rank)

    def actor_resources(self) -> dict[str, Any]:
        """Ray actor options that take this pool's share of one bundle (1/max_colocate of it)."""
        share = 1.0 / self.max_colocate
        bundle = self.bundle()
        options: dict[str, Any] = {"num_cpus": bundle.pop("CPU") * share}
        if "GPU" in bundle:
            options["num_gpus"] = bundle.pop("GPU") * share
        if bundle:
            options["resources"] = {name: amount * share for name, amount in bundle.items()}
        return options

    def claim(self, role: str) -> None:
        """Record that a worker group of `role` takes a share; ConfigError when the pool is full."""
        if len(self._roles) >= self.max_colocate:
            raise ConfigError(
                f"resource pool {self.name!r} holds at most {self.max_colocate} worker group(s) per device "
                f"(max_colocate={self.max_colocate}) and already hosts {self._roles}; cannot add {role!r}. "
                "Raise max_colocate to run it in separate processes on the same devices, host the roles "
                "in one process with HostWorker, or give it its own pool."
            )
        self._roles.append(role)

    def release(self, role: str) -> None:
        if role in self._roles:
            self._roles.remove(role)

    def node_ids(self) -> list[str]:
        """Ray node id that each of the pool's node groups landed on."""
        if not self._ready:
            raise ClusterError(f"resource pool {self.name!r} is not reserved yet: call wait() first")
        table = [ray.util.placement_group_table(group) for group in self._groups]
        return [entry["bundles_to_node_id"][0] for entry in table]

    def shutdown(self) -> None:
        """Release the placement groups (safe to call twice, and after Ray has shut down)."""
        groups, self._groups, self._ready = self._groups, [], False
        if ray.is_initialized():
            for group in groups:
                try:
                    remove_placement_group(group)
                except Exception:  # already gone with its job or cluster
                    pass
        unregister_for_cleanup(self)

    def __repr__(self) -> str:
        return (f"ResourcePool({self.name!r}, nnodes={self.nnodes}, devices_per_node={self.devices_per_node}, "
                f"device={self.device!r})")

