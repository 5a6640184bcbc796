"""The hybrid engine's weight sync: training engine shards -> reshard -> rollout engine.

Every rank of the training world runs `WeightSync.sync()` at the same time (SPMD), from its own
plan (`megarl.hybrid.rank_plan.RankPlanner`): what it copies locally, sends and receives, planned
at a cost that does not grow with the world size, with senders by the rule of
`megarl.hybrid.sender_rule` that every rank evaluates alike. With rollout
tensor-parallel size 1 each rank receives HF-named full tensors: written into the engine's own
tensors where it offers them and the sync is not verified (the HF engine), else handed to its
`update_weights` (any engine; see `sync_shards`). With rollout TP > 1 each rank receives only vLLM's
per-rank fused parameters and copies them in place into the vLLM model of its process.

Expert-parallel training (EP > 1): each rank holds only its expert-parallel rank's experts,
numbered 0..E/ep-1 locally (Megatron-Core's `MoELayer`: global expert = ep_rank * E/ep + local;
sequential experts, `local_experts.{i}`, in both layer specs since grouped GEMM is off), each
split over the expert tensor-parallel ranks (expert TP, by default the TP size). The plan keys
those shards by (expert TP rank, pp, ep rank) and fetches every other expert from a holder of it.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from megarl.errors import ConfigError
from megarl.hybrid.executor import ExecStats, Transport, execute_plan
from megarl.hybrid.plan import DEFAULT_BUCKET_BYTES, ReshardPlan
from megarl.hybrid.rank_plan import RankPlanner
from megarl.hybrid.slices import vllm_expert_view
from megarl.hybrid.verify import WeightSyncError
from megarl.layout import ParallelLayout
from megarl.models.weight_map import stage_entries


def local_spec_names(spec: Any, pp_rank: int, pp_size: int) -> dict[str, str]:
    """TransformerEngine-spec parameter names -> local-spec names on this stage (the plan's names)."""
    out = {}
    for entry, name, _ in stage_entries(spec, pp_rank, pp_size):
        if entry.te_name is not None:
            layer = name.split(".")[2] if entry.per_layer else None
            out[entry.te_name.format(layer=layer)] = name
    return out


def training_shards(named_weights: Iterable[tuple[str, torch.Tensor]], spec: Any, pp_rank: int,
                    pp_size: int) -> dict[str, torch.Tensor]:
    """This rank's Megatron parameters keyed by local-spec name (TE names translated)."""
    rename = local_spec_names(spec, pp_rank, pp_size)
    return {rename.get(name, name): t for name, t in named_weights}


def _vllm_targets(rollout_engine: Any, plan: ReshardPlan, rank: int) -> dict[str, torch.Tensor]:
    """The vLLM model's own parameters that the plan fills on this rank, checked by name and shape."""
    return engine_targets(rollout_engine, plan.engine_tensors[rank])


def engine_targets(rollout_engine: Any, tensors: Iterable[Any]) -> dict[str, torch.Tensor]:
    """The vLLM model's own parameters for `tensors` (each with `name` and `shape`, vLLM's
    per-rank names and shapes), checked by name and shape; one expert of a fused expert parameter
    is a view of it."""
    params = dict(rollout_engine.engine_model().named_parameters())
    targets = {}
    experts: dict[str, torch.Tensor] = {}
    for t in tensors:
        view = vllm_expert_view(t.name)  # one expert of a routed-expert (FusedMoE) parameter
        if view is not None:
            base, e = view
            if base not in params:
                raise ConfigError(f"reshard: the vLLM model has no expert parameter {base!r}; it has e.g. "
                                  f"{sorted(n for n in params if '.experts.' in n)[:4]}")
            if base not in experts:
                # vLLM holds every expert on every rank (tensor-parallel experts).
                experts[base] = rollout_engine.fused_expert_target(base, (params[base].shape[0], *t.shape))
            targets[t.name] = experts[base][e]
            continue
        p = params.get(t.name)
        if p is None:
            raise ConfigError(f"reshard: the vLLM model has no parameter {t.name!r}; it has e.g. {sorted(params)[:4]}")
        if tuple(p.shape) != tuple(t.shape):
            raise ConfigError(f"reshard: vLLM parameter {t.name!r} has shape {tuple(p.shape)}, the plan expects "
                              f"{tuple(t.shape)}; is the engine's tensor_parallel_size the rollout TP size?")
        targets[t.name] = p.data
    _check_covers_engine(params, targets)
    return targets


def _check_covers_engine(params: Mapping[str, torch.Tensor], names: Iterable[str]) -> None:
    """Refuse targets that leave a parameter of this rank's vLLM model unwritten, before anything is
    written: the sync then marks every weight updated, so a parameter the plan misses would keep its
    old values (after a discarding sleep, undefined ones) unnoticed. A fused expert parameter is
    covered when every one of its experts is."""
    covered: set[str] = set()
    experts: dict[str, set[int]] = {}
    for name in names:
        view = vllm_expert_view(name)
        if view is None:
            covered.add(name)
        else:
            experts.setdefault(view[0], set()).add(view[1])
    covered.update(base for base, seen in experts.items() if len(seen) == params[base].shape[0])
    missing = sorted(set(params) - covered)
    if missing:
        raise ConfigError(
            f"reshard: the plan writes no values into {len(missing)} parameter(s) of this rank's vLLM model, "
            f"e.g. {missing[:4]}; a sync must fill every parameter (is the model's architecture one the weight "
            f"map covers, with the same parameters as the checkpoint the engine loaded?)")


def sync_shards(plan: ReshardPlan, shards: Mapping[str, torch.Tensor], rollout_engine: Any,
                group: dist.ProcessGroup | None = None, verify: bool = True,
                transport: Transport | None = None) -> ExecStats:
    """Reshard this rank's Megatron shards (local-spec names) into the rollout engine. `plan`
    covers this rank: its own plan or the whole-world one (see `execute_plan`).

    Engine layout "hf" (rollout TP 1): full HF-named tensors, written into the engine's own when
    the sync is not verified and the engine offers them (`weight_targets`, the HF engine), else
    handed to `update_weights` after the check, so any engine works.
    Layout "vllm": pieces are written straight into the vLLM model's parameters of this process
    (vLLM's loaders want full HF tensors, which would defeat the sharding).
    `verify`: compare every bucket's sender and receiver fingerprints (see `megarl.hybrid.verify`);
    in layout "hf" before the engine takes the weights, in layout "vllm" after the pieces were
    written in place, so a failed check leaves the engine refusing to generate until a whole sync. `transport`: point-to-point over `group` by default.
    """
    start = time.perf_counter()
    stats = _deliver(plan, shards, rollout_engine, group, verify, transport)
    stats.seconds = time.perf_counter() - start  # the engine's taking of the weights included
    return stats


def _deliver(plan: ReshardPlan, shards: Mapping[str, torch.Tensor], rollout_engine: Any,
             group: dist.ProcessGroup | None, verify: bool, transport: Transport | None) -> ExecStats:
    """`sync_shards` without its timing."""
    if plan.engine == "hf":
        # Unverified, straight into the engine's own tensors where it offers them (the HF engine):
        # no second copy of the model. A verified sync fills new tensors and hands them over only
        # once the check passed, so a bucket that arrives changed never reaches the engine; so does
        # an engine without tensors of its own to offer (vLLM at TP 1: its loaders fuse and shard).
        own = None if verify else rollout_engine.weight_targets(
            {t.name: t.shape for t in plan.engine_tensors[dist.get_rank(group)]})
        with torch.no_grad():
            tensors, stats = execute_plan(plan, shards, group, out=own, verify=verify, transport=transport)
        if own is None:
            rollout_engine.update_weights(tensors.items())
        else:
            rollout_engine.weights_written(tensors)
        return stats
    if rollout_engine.state.value not in ("awake", "weights_only"):
        raise ConfigError(f"rollout engine is {rollout_engine.state.value}; wake it up before a weight sync")
    targets = _vllm_targets(rollout_engine, plan, dist.get_rank(group))
    with torch.no_grad():
        try:
            _, stats = execute_plan(plan, shards, group, out=targets, verify=verify, transport=transport)
        except WeightSyncError:
            rollout_engine.mark_weights_damaged()  # the changed buckets are in its parameters already
            raise
        if any(vllm_expert_view(name) for name in targets):
            rollout_engine.finish_fused_experts()  # e.g. the CPU kernel's prepacked layout
    rollout_engine.mark_weights_updated()  # e.g. vLLM's prefix cache was computed with the old weights
    return stats


def checked_verify_every(verify_every: int) -> int:
    """`rollout.sync_verify_freq`: 0 (never) or k >= 1 (every k-th sync, the first included)."""
    if verify_every < 0:
        raise ConfigError(f"weight sync: verify_every={verify_every}; valid: 0 (never) or k >= 1 (every k-th sync)")
    return verify_every


def verify_due(verify_every: int, syncs_done: int) -> bool:
    """Whether the next sync (after `syncs_done` of them) is verified."""
    return verify_every > 0 and syncs_done % verify_every == 0


def _first_weight(train_engine: Any) -> torch.Tensor:
    """One of the training engine's parameters (their device and dtype are those of all)."""
    return next(iter(train_engine.get_named_weights()))[1]


def engine_shards(train_engine: Any) -> dict[str, torch.Tensor]:
    """The training engine's parameters of this rank keyed as the plan names them."""
    r = train_engine.ranks
    return training_shards(train_engine.get_named_weights(), train_engine.spec, r.pp_rank, r.pp_size)


def own_plan(train_engine: Any, rollout_tp: int, bucket_bytes: int,
             group: dist.ProcessGroup | None = None) -> ReshardPlan:
    """This rank's part of the reshard from the training engine's layout (which must span `group`,
    in Megatron's rank order) to the rollout layout of `rollout_tp`, over the same ranks."""
    r = train_engine.ranks
    layout = ParallelLayout(tp=r.tp_size, pp=r.pp_size, dp=r.dp_size, cp=r.cp_size, ep=r.ep_size, etp=r.etp_size)
    if layout.world_size != dist.get_world_size(group):
        raise ConfigError(f"weight sync: training layout {layout} does not span the group of "
                          f"{dist.get_world_size(group)} ranks")
    c = layout.coord(dist.get_rank(group))
    if (c.etp_rank, c.ep_rank) != (r.etp_rank, r.ep_rank):  # the plan would fetch the wrong experts
        raise ConfigError(f"weight sync: rank {dist.get_rank(group)} is expert-parallel rank {r.ep_rank}, "
                          f"expert tensor-parallel rank {r.etp_rank} in Megatron, the plan's rank order puts it "
                          f"at {c.ep_rank}, {c.etp_rank}; the training process groups must use Megatron's "
                          "default order tp-cp-ep-dp-pp")
    dtype = _first_weight(train_engine).dtype
    planner = RankPlanner(train_engine.spec, layout, ParallelLayout.rollout(rollout_tp, layout.world_size),
                          "hf" if rollout_tp == 1 else "vllm", dtype, bucket_bytes)
    return planner.plan(dist.get_rank(group))


class WeightSync:
    """Plans this rank's part once (`plan`: a `ReshardPlan` covering this rank alone), then moves
    the training engine's weights into the rollout engine on `sync()`.

    Args:
        train_engine: a `MegatronEngine` (needs `spec`, `ranks` and `get_named_weights()`).
        rollout_engine: a `RolloutEngine`; with `rollout_tp` > 1 a vLLM engine of this process.
        rollout_tp: rollout tensor-parallel size (consecutive ranks form one engine).
        bucket_bytes: bound on the bytes one pair of ranks exchanges per step.
        group: the process group spanning the training world (default: the world).
        verify_every: verify the received weights on every k-th sync, the first included (0: never).
    """

    def __init__(self, train_engine: Any, rollout_engine: Any, rollout_tp: int = 1,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, group: dist.ProcessGroup | None = None,
                 verify_every: int = 1) -> None:
        self.train_engine = train_engine
        self.rollout_engine = rollout_engine
        self.verify_every = checked_verify_every(verify_every)
        self.syncs_done = 0
        self.group = group
        self.plan = own_plan(train_engine, rollout_tp, bucket_bytes, group)
        # Whether any rank of the world receives a piece from another. When none does (each rank
        # holds its whole rollout shard, e.g. data parallelism alone), every rank copies from itself,
        # nothing crosses a process, and a sync needs no collective, the verification's included.
        buckets = torch.tensor([len(self.plan.steps)], dtype=torch.int64, device=_first_weight(train_engine).device)
        dist.all_reduce(buckets, group=group)
        self.exchanges = bool(buckets.item())

    def sync(self, transport: Transport | None = None) -> ExecStats:
        """Reshard and deliver; returns this rank's transfer statistics. `transport`: how buckets
        move (default: point-to-point over the group)."""
        start = time.perf_counter()
        shards = engine_shards(self.train_engine)
        verify = self.exchanges and verify_due(self.verify_every, self.syncs_done)
        stats = sync_shards(self.plan, shards, self.rollout_engine, self.group, verify=verify, transport=transport)
        stats.seconds = time.perf_counter() - start
        self.syncs_done += 1
        return stats
