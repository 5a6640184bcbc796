"""The parallel layout vocabulary shared by the engine, the hybrid reshard and the cluster dispatch.

- `ParallelLayout`: degrees of parallelism (tp, pp, dp, cp, ep, etp) of one world; `dp=0` means
  "derive it from the world size" (`resolved`); `etp=0` means "expert tensor parallel size = tp"
  (set at construction).
- `RankCoord`: one rank's position in a layout: its rank and size along every dimension.

Rank order (Megatron-Core 0.16.1's default "tp-cp-ep-dp-pp", `parallel_state.
initialize_model_parallel`): TP is the fastest-varying coordinate, then CP, then DP, then PP:

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

The expert layers regroup the tp*cp*dp ranks of one pipeline stage (Megatron's expert rank
generator: order "tp-ep-dp" with the expert tensor-parallel size etp in place of tp, CP folded into
the expert data-parallel size edp = tp*cp*dp / (etp*ep)). With s = rank's index in its stage:

    s = etp_rank + etp * (ep_rank + ep * edp_rank)

At etp = tp (Megatron's default) this is ep_rank = (cp_rank + cp * dp_rank) % ep, and expert
weights are split over the same TP ranks as the dense ones. The expert coordinates do not change
any other coordinate.

The rollout layout is the same type with pp = cp = ep = 1 (`ParallelLayout.rollout`): tp
consecutive ranks form one rollout engine's tensor-parallel group, dp = world / tp engines. So a
rollout layout with the training TP keeps every tensor-parallel shard on the rank that trained it.

Pure arithmetic: no torch here. `megarl.megatron.parallel` creates the process groups of a layout
and reads this process's `RankCoord` back from Megatron (`current_ranks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.errors import ConfigError

# vLLM pads the vocabulary to a multiple of this before splitting it over its tensor-parallel ranks
# (vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE).
VLLM_VOCAB_PADDING = 64


@dataclass(frozen=True, kw_only=True)
class RankCoord:
    """One rank's coordinates: its rank and, per dimension, its index and the dimension's size.

    Ranks with the same `dp_rank` hold the same data shard; the result of a data-parallel call is
    taken from the one rank per `dp_rank` that `is_collect_rank`.
    """

    rank: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int
    dp_size: int
    cp_rank: int = 0
    cp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0  # expert tensor-parallel rank: the split of the expert weights
    etp_size: int = 1
    edp_rank: int = 0  # expert data-parallel rank: the replica of the expert weights
    edp_size: int = 1

    @property
    def is_collect_rank(self) -> bool:
        """The last pipeline stage and rank 0 of its tensor- and context-parallel groups."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.pp_rank == self.pp_size - 1

    @classmethod
    def data_parallel_only(cls, rank: int, world_size: int) -> RankCoord:
        """Every rank is its own data-parallel replica."""
        return cls(rank=rank, dp_rank=rank, dp_size=world_size)


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of parallelism. `dp` is derived from the world size when left at 0 (`resolved`);
    `etp` (expert tensor parallel size) is set to tp when left at 0."""

    tp: int = 1
    pp: int = 1
    dp: int = 0
    cp: int = 1
    ep: int = 1
    etp: int = 0

    def __post_init__(self) -> None:
        if self.etp == 0:  # Megatron's default: the experts split as the dense layers
            object.__setattr__(self, "etp", self.tp)

    @classmethod
    def rollout(cls, tp: int, world_size: int) -> ParallelLayout:
        """The rollout layout: `tp` ranks per engine, `world_size / tp` engines (its dp)."""
        if tp < 1 or world_size < 1 or world_size % tp:
            raise ConfigError(
                f"rollout layout: tensor_model_parallel_size={tp} must be >= 1 and divide the "
                f"world size {world_size}"
            )
        return cls(tp=tp, dp=world_size // tp)

    @property
    def model_parallel_size(self) -> int:
        """Ranks per model replica: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    @property
    def world_size(self) -> int:
        """tp * cp * dp * pp (the layout must be resolved)."""
        self._require_resolved()
        return self.model_parallel_size * self.dp

    def resolved(self, world_size: int) -> ParallelLayout:
        """This layout with `dp` filled in and checked against `world_size`."""
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel layout: {name}={getattr(self, name)} must be >= 1")
        if self.etp < 0:
            raise ConfigError(f"parallel layout: etp={self.etp} must be >= 1 (or 0: the tensor-parallel size)")
        mp = self.model_parallel_size
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
        if self.etp == self.tp and (dp * self.cp) % self.ep != 0:
            raise ConfigError(f"parallel layout: ep={self.ep} must divide dp*cp={dp * self.cp} (expert-parallel "
                              "groups are made of data- and context-parallel ranks)")
        stage = self.tp * self.cp * dp
        if stage % (self.etp * self.ep) != 0:
            raise ConfigError(f"parallel layout: etp*ep = {self.etp}*{self.ep} must divide the {stage} ranks of a "
                              f"pipeline stage (tp*cp*dp = {self.tp}*{self.cp}*{dp})")
        return ParallelLayout(tp=self.tp, pp=self.pp, dp=dp, cp=self.cp, ep=self.ep, etp=self.etp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size: replicas of each expert shard, tp*cp*dp / (etp*ep)."""
        self._require_resolved()
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    @property
    def experts_split_apart(self) -> bool:
        """Whether the expert weights are sharded differently from the dense ones (ep > 1 or etp != tp)."""
        return self.ep > 1 or self.etp != self.tp

    def coord(self, rank: int) -> RankCoord:
        """Coordinates of global rank `rank` (TP fastest, then CP, DP, PP; see the module doc)."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"parallel layout {self}: rank {rank} outside [0, {self.world_size})")
        tp_rank, rest = rank % self.tp, rank // self.tp
        cp_rank, rest = rest % self.cp, rest // self.cp
        dp_rank, pp_rank = rest % self.dp, rest // self.dp
        in_stage = rank % (self.tp * self.cp * self.dp)
        etp_rank, rest = in_stage % self.etp, in_stage // self.etp
        ep_rank, edp_rank = rest % self.ep, rest // self.ep
        return RankCoord(
            rank=rank,
            tp_rank=tp_rank, tp_size=self.tp,
            pp_rank=pp_rank, pp_size=self.pp,
            dp_rank=dp_rank, dp_size=self.dp,
            cp_rank=cp_rank, cp_size=self.cp,
            ep_rank=ep_rank, ep_size=self.ep,
            etp_rank=etp_rank, etp_size=self.etp,
            edp_rank=edp_rank, edp_size=self.edp,
        )

    def rank(self, coord: RankCoord) -> int:
        """Inverse of `coord`: the global rank at `coord`'s tp/cp/dp/pp ranks."""
        sizes = (coord.tp_size, coord.pp_size, coord.dp_size, coord.cp_size)
        if sizes != (self.tp, self.pp, self.dp, self.cp):
            raise ConfigError(f"parallel layout {self}: coordinates {coord} are of another layout")
        return self._rank(coord.tp_rank, coord.cp_rank, coord.dp_rank, coord.pp_rank)

    def replicas(self, tp_rank: int, pp_rank: int) -> list[int]:
        """Global ranks holding the same weights as model shard (tp_rank, pp_rank): its DP and CP
        replicas, DP-major."""
        self._require_resolved()
        return [self._rank(tp_rank, cp, dp, pp_rank) for dp in range(self.dp) for cp in range(self.cp)]

    def expert_rank(self, etp_rank: int, ep_rank: int, edp_rank: int, pp_rank: int) -> int:
        """The global rank at expert coordinates (etp_rank, ep_rank, edp_rank) of stage `pp_rank`."""
        return etp_rank + self.etp * (ep_rank + self.ep * (edp_rank + self.edp * pp_rank))

    def _rank(self, tp_rank: int, cp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

    def _require_resolved(self) -> None:
        if self.dp < 1:
            raise ConfigError(f"parallel layout {self}: dp is not resolved; call resolved(world_size) first")
