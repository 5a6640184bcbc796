"""Rank coordinates of the training layout (Megatron's) and of the rollout layout.

Training: Megatron-Core's default rank order "tp-cp-ep-dp-pp" (megatron-core 0.16.1,
`parallel_state.initialize_model_parallel`): TP is the fastest-varying coordinate, then CP, then
DP, then PP. EP only regroups the data-parallel ranks for expert layers, so it does not change a
dense model's coordinates.

Rollout: TP_r consecutive ranks form one rollout tensor-parallel group (like Megatron's TP groups),
so a rollout layout with TP_r == TP keeps every tensor-parallel shard on the rank that trained it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.errors import ConfigError


@dataclass(frozen=True)
class TrainCoord:
    """One training rank's position: tensor, context, data and pipeline parallel ranks."""

    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class TrainLayout:
    """Megatron training layout over `world_size = tp * cp * dp * pp` ranks."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train layout: {name}={getattr(self, name)} must be >= 1")
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(f"train layout: ep={self.ep} must divide dp*cp={self.dp * self.cp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def coord(self, rank: int) -> TrainCoord:
        """Coordinates of global rank `rank` (TP fastest, then CP, DP, PP)."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"train layout {self}: rank {rank} outside [0, {self.world_size})")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return TrainCoord(tp=tp, cp=cp, dp=dp, pp=pp)

    def rank(self, coord: TrainCoord) -> int:
        """Inverse of `coord`."""
        return coord.tp + self.tp * (coord.cp + self.cp * (coord.dp + self.dp * coord.pp))

    def replicas(self, tp: int, pp: int) -> list[int]:
        """Global ranks holding the same weights as model shard (tp, pp): its DP and CP replicas."""
        return [self.rank(TrainCoord(tp, cp, dp, pp)) for dp in range(self.dp) for cp in range(self.cp)]


@dataclass(frozen=True)
class RolloutLayout:
    """Rollout layout: `tp` tensor-parallel ranks per engine, `world_size / tp` engine replicas."""

    tp: int
    world_size: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.world_size < 1 or self.world_size % self.tp:
            raise ConfigError(
                f"rollout layout: tensor_model_parallel_size={self.tp} must be >= 1 and divide the "
                f"world size {self.world_size}"
            )

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    def coord(self, rank: int) -> tuple[int, int]:
        """(dp_r, tp_r) of global rank `rank`: consecutive ranks form one TP group."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rollout layout {self}: rank {rank} outside [0, {self.world_size})")
        return rank // self.tp, rank % self.tp
