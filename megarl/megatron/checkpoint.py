"""Engine checkpoints with Megatron distributed checkpointing (torch_dist), reshardable on load.

Model and optimizer state are saved as sharded tensors in the canonical (unsplit) layout, so a
checkpoint saved at one TP/PP/DP layout loads at another. Two optimizer kinds, as
`optim.build_optimizer` makes them (`use_distributed_optimizer`), each part of Megatron's
`ChainedOptimizer` (one for a dense model, two with experts):
- the distributed optimizer (`DistributedOptimizer`, Adam state sharded over DP) uses
  `fully_reshardable` sharding (the default format fails at save in megatron-core 0.16.1): tensors
  `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`, `param` the fp32 main parameter;
- the plain optimizer (`FP32Optimizer`, or `Float16OptimizerWithFloat16Params` for bf16; Adam state
  replicated over DP) uses Megatron's own `sharded_state_dict`, which lays each state out like its
  model parameter: `optimizer.state.{exp_avg,exp_avg_sq}.<model key>`, with bf16 also
  `optimizer.state.fp32_param.<model key>` (fp32 training: the model's parameters are the main
  parameters). Adam's step is kept as `common_step` in the common state.
The kind is recorded (`optimizer_kind`); a checkpoint loads into an optimizer of its own kind only
(the tensors differ), at any layout.

Work-arounds for the native (no Apex/TE) Adam of megatron-core 0.16.1, all done here
with public methods rather than by patching Megatron:
- a fresh optimizer has no Adam state, and cannot describe what it wants to save or load (the
  plain optimizer would save no moments at all): its state is initialised (zeros, step 0) first;
- the distributed optimizer's `load_state_dict` makes every parameter share one `step` tensor
  (Adam's step would advance by the parameter count per update) and the fully-reshardable loader
  fails on `step`: the parameter state is loaded with `step` held aside, then each parameter (of
  either kind) gets its own step, read from the checkpoint's common state.
The directory is written under a temporary name and renamed when complete; `metadata.json`,
written last by Megatron, marks a complete checkpoint.

A load is checked, not trusted: the save records a fingerprint of the optimizer state (element
count and float64 sums of the fp32 main parameters (with the plain fp32 optimizer: the model's
parameters), |first moments| and second moments over every element once, whatever the layout),
the Adam step and the LR schedule's step; after a load the
same fingerprint is taken from what was loaded and must match (up to summation order), and the
Adam step and the schedule must continue from the saved step. Any difference is a
`CheckpointError` naming the quantity. (Zero moments alone are not an error: a run whose
gradients were all zero so far, e.g. all rewards equal, has them.)

A checkpoint holds state, the config holds settings: a load restores the schedule's step, Adam's
step and moments, but the LR schedule (lr, min_lr, warmup, decay steps and style, weight decay) and
Adam's betas and eps stay this run's, and each one that differs from the checkpoint's is logged.
So a finished run is extended by raising total_training_steps, or resumed with another lr.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megarl.errors import CheckpointError
from megarl.megatron.checkpoint_format import (
    DISTRIBUTED, FORMAT_VERSION, MAIN_PARAM_STATE, OPTIMIZER_KINDS, PLAIN_FLOAT16, PLAIN_FP32, saved_optimizer_kind,
)
from megarl.megatron.model import unwrap

logger = logging.getLogger(__name__)
FINGERPRINT_FIELDS = ("elements", "param_abs_sum", "exp_avg_abs_sum", "exp_avg_sq_sum")
FINGERPRINT_RTOL = 1e-6  # float64 sums of the same values in another order (another layout)

_OPT_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    # Avoids a CUDA-only gather path of the fully-reshardable format.
    "distrib_optim_fully_reshardable_mem_efficient": True,
}


# Settings of the LR schedule in Megatron's scheduler state, and the optim key each comes from.
_SCHEDULE_SETTINGS = (
    ("max_lr", "optim.lr"),
    ("min_lr", "optim.min_lr"),
    ("lr_warmup_steps", "optim.lr_warmup_steps"),
    ("lr_decay_steps", "optim.total_training_steps"),
    ("lr_decay_style", "optim.lr_scheduler"),
    ("start_wd", "optim.weight_decay"),
)
# Adam's settings in the optimizer's parameter groups (the rest of a group is structure, or set by
# the scheduler at every step: lr, weight_decay).
_ADAM_SETTINGS = (("betas", "optim.betas"), ("eps", "optim.eps"))


def _dist_optimizers(optimizer: Any) -> list[Any]:
    """The Megatron optimizers inside `optimizer` (distributed or plain): one for a dense model, two
    for a mixture-of-experts model (dense parameters, then expert parameters with their own DP group)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    return [optimizer] if chained is None else list(chained)


def _part_kind(part: Any) -> str:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params

    if isinstance(part, DistributedOptimizer):
        return DISTRIBUTED
    if isinstance(part, Float16OptimizerWithFloat16Params):
        return PLAIN_FLOAT16
    if isinstance(part, FP32Optimizer):
        return PLAIN_FP32
    raise CheckpointError(f"cannot checkpoint a {type(part).__name__} (supported: DistributedOptimizer, "
                          "FP32Optimizer, Float16OptimizerWithFloat16Params)")


def optimizer_kind(optimizer: Any) -> str:
    """DISTRIBUTED, PLAIN_FP32 or PLAIN_FLOAT16: the kind of every part of `optimizer`."""
    kinds = {_part_kind(part) for part in _dist_optimizers(optimizer)}
    if len(kinds) != 1:
        raise CheckpointError(f"the optimizer's parts are of different kinds: {sorted(kinds)}")
    return kinds.pop()


def _inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    return [opt.optimizer for opt in _dist_optimizers(optimizer)]


def _adam_states(optimizer: Any) -> list[dict[str, Any]]:
    return [state for inner in _inner_optimizers(optimizer) for state in inner.state.values()]


def adam_step(optimizer: Any) -> int:
    """Adam's step count (equal for all parameters; 0 before the first update)."""
    steps = {float(s["step"]) for s in _adam_states(optimizer) if "step" in s}
    if len(steps) > 1:
        raise CheckpointError(f"Adam parameters disagree on the step count: {sorted(steps)}")
    return int(steps.pop()) if steps else 0


def _init_adam_state(optimizer: Any) -> None:
    """Give every main parameter its own zero Adam state (what torch creates at the first step)."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state.get(p):
                    inner.state[p] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }


def _set_adam_step(optimizer: Any, step: int) -> None:
    for state in _adam_states(optimizer):
        state["step"] = torch.tensor(float(step))


def _sharded_state(engine: Any, is_loading: bool) -> dict[str, Any]:
    model_sd = unwrap(engine.ddp).sharded_state_dict()  # standard keys: decoder.layers..., no wrapper prefix
    # One entry per optimizer part; their sharded keys name disjoint parameters. (A plain optimizer
    # ignores the metadata, which only selects the distributed optimizer's format.)
    return {
        "model": model_sd,
        "optimizer": {
            f"part{i}": opt.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPT_METADATA)
            for i, opt in enumerate(_dist_optimizers(engine.optimizer))
        },
    }


def _model_main_params(engine: Any, sharded: dict[str, Any]) -> list[Any]:
    """The model's sharded tensors of the parameters a plain fp32 optimizer steps (its main
    parameters); none for the other kinds, whose main parameters are optimizer state."""
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    return [value for part in _dist_optimizers(engine.optimizer) if _part_kind(part) == PLAIN_FP32
            for value in get_param_id_to_sharded_param_map(sharded["model"], part.get_parameters()).values()]


def _optimizer_fingerprint(sharded: dict[str, Any], engine: Any) -> dict[str, float]:
    """Collective. `FINGERPRINT_FIELDS` of the optimizer state in `sharded` (from `_sharded_state`),
    summed over the world counting each element once: only main replicas contribute, and of
    vocabulary-padded tensors only the rows of the `vocab_size` real tokens (the padding depends on
    the TP size). The fp32 main parameters are the optimizer's `param` (distributed) or `fp32_param`
    (plain bf16) state, or the model's parameters (plain fp32)."""

    vocab_size = engine.spec.vocab_size
    main_prefixes = tuple(f"optimizer.state.{name}." for name in MAIN_PARAM_STATE.values() if name)
    model_main = _model_main_params(engine, sharded)
    model_main_ids = {id(value) for value in model_main}
    sums = torch.zeros(len(FINGERPRINT_FIELDS), dtype=torch.float64)
    for value in list(nested_values(sharded["optimizer"])) + model_main:
        # A factory (e.g. SwiGLU's fused gate/up weight) holds this rank's whole local tensor.
        if not isinstance(value, (ShardedTensor, ShardedTensorFactory)) or not is_main_replica(value.replica_id):
            continue
        data = value.data.detach()
        if isinstance(value, ShardedTensor) and value.allow_shape_mismatch:  # vocabulary rows, padded
            first_row = value.global_offset[value.prepend_axis_num]
            data = data[: max(0, min(data.shape[0], vocab_size - first_row))]
        data = data.to("cpu", torch.float64)
        if id(value) in model_main_ids or value.key.startswith(main_prefixes):
            sums[0] += data.numel()
            sums[1] += data.abs().sum()
        elif value.key.startswith("optimizer.state.exp_avg."):
            sums[2] += data.abs().sum()
        elif value.key.startswith("optimizer.state.exp_avg_sq."):
            sums[3] += data.sum()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    sums = sums.to(device)
    dist.all_reduce(sums)
    return {name: float(v) for name, v in zip(FINGERPRINT_FIELDS, sums.cpu().tolist())}


def _param_group_settings(optimizer: Any) -> list[dict[str, Any]]:
    """Everything but the parameters of every parameter group, in order."""
    return [{k: v for k, v in group.items() if k != "params"}
            for inner in _inner_optimizers(optimizer) for group in inner.param_groups]


def _restore_param_group_settings(optimizer: Any, settings: list[dict[str, Any]]) -> None:
    """Put back this run's group settings after a load replaced them with the checkpoint's: Megatron's
    LR schedule reads max_lr/min_lr from the groups before its own values, Adam its betas and eps."""
    groups = [group for inner in _inner_optimizers(optimizer) for group in inner.param_groups]
    if len(groups) != len(settings):
        raise CheckpointError(f"the optimizer has {len(groups)} parameter groups after the load, "
                              f"{len(settings)} before")
    for group, before in zip(groups, settings):
        group.update(before)


def _plain(value: Any) -> Any:
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else value


def changed_settings(config_schedule: dict[str, Any], saved_schedule: dict[str, Any],
                     config_groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> list[str]:
    """``"optim.KEY now (checkpoint: then)"`` for each optimizer setting of this run that differs
    from the checkpoint's: the scheduler states (Megatron's `state_dict`) and the parameter groups'
    Adam settings. Warmup and total steps are counted in optimizer steps here."""
    differ = []
    constant = config_schedule.get("lr_decay_style") == saved_schedule.get("lr_decay_style") == "constant"
    for key, name in _SCHEDULE_SETTINGS:
        if key == "min_lr" and constant:
            continue  # a constant schedule's min_lr is its lr (optim.build_scheduler), not optim.min_lr
        if key in saved_schedule and key in config_schedule and saved_schedule[key] != config_schedule[key]:
            differ.append(f"{name} {config_schedule[key]!r} (checkpoint: {saved_schedule[key]!r})")
    for key, name in _ADAM_SETTINGS:
        now = next((g[key] for g in config_groups if key in g), None)
        then = next((g[key] for g in saved_groups if key in g), None)
        if now is not None and then is not None and _plain(now) != _plain(then):
            differ.append(f"{name} {_plain(now)!r} (checkpoint: {_plain(then)!r})")
    return differ


def check_restored(path: Path, saved: dict[str, Any], engine: Any, loaded: dict[str, float]) -> None:
    """Raise `CheckpointError` naming every quantity the load did not bring back (see the module
    docstring). `saved`: the checkpoint's `megarl` entry; `loaded`: the fingerprint after the load."""
    problems = []
    want = saved.get("optimizer_fingerprint")
    fields = FINGERPRINT_FIELDS
    if want is not None and "optimizer_kind" not in saved and float(want["elements"]) == 0:
        # Saved by a plain optimizer before megarl recorded the kind: its fingerprint has no main
        # parameters (only the distributed optimizer's `param` state was counted then).
        fields = tuple(f for f in FINGERPRINT_FIELDS if f not in ("elements", "param_abs_sum"))
    if want is not None:
        for name in fields:
            w, g = float(want[name]), loaded[name]
            if abs(g - w) > FINGERPRINT_RTOL * max(abs(w), 1e-30):
                problems.append(f"optimizer {name} is {g!r} after the load, {w!r} when saved")
    step = adam_step(engine.optimizer)
    if step != int(saved["adam_step"]):
        problems.append(f"Adam step is {step} after the load, {saved['adam_step']} when saved")
    if want is None and int(saved["adam_step"]) > 0 and not loaded["exp_avg_sq_sum"] > 0:
        # Without a recorded fingerprint (older checkpoints) zero moments may be a reset or may be
        # real (every gradient so far zero, e.g. all rewards equal): say so, do not stop.
        logger.warning("%s: Adam's second moments are all zero after %d steps", path, saved["adam_step"])
    sched_want = int(saved["scheduler"]["num_steps"])
    if engine.scheduler.num_steps != sched_want:
        problems.append(f"LR schedule is at step {engine.scheduler.num_steps} after the load, {sched_want} when saved")
    if problems:
        raise CheckpointError(f"{path}: the load did not restore the saved state: " + "; ".join(problems))


def _write_results_in_this_process() -> None:
    """Megatron's torch_dist writer hands a rank's write results back through a queue that it makes
    once per process with a spawned multiprocessing Manager: a server process that lives as long as
    the worker and outlives it when the worker dies without running its exit handlers (seen: a
    worker killed with its Ray cluster left that server running for over a minute). megarl saves
    synchronously, where the results are put and taken in the saving process itself (megatron-core
    0.16.1: `AsyncRequest.execute_sync`, `FileSystemWriterAsync.retrieve_write_results`), so a plain
    queue of this process serves and no server process is started."""
    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


def save(engine: Any, path: str | os.PathLike[str]) -> None:
    """Collective: every rank calls it with the same path."""

    _write_results_in_this_process()
    target = Path(path)
    tmp = target.with_name(target.name + ".partial")
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    _init_adam_state(engine.optimizer)  # a fresh optimizer cannot describe its state otherwise
    state = _sharded_state(engine, is_loading=False)
    state["megarl"] = {
        "format_version": FORMAT_VERSION,
        "family": engine.spec.family,
        "role": engine.role,
        "hf_config": dict(engine.spec.hf_config),  # lets `megarl checkpoint verify` list the expected tensors
        # The HF directory the engine was built from: an export copies its tokenizer files
        # (megarl.convert.mcore_to_hf.find_hf_source). None for weights loaded otherwise.
        "hf_dir": engine.hf_dir,
        "adam_step": adam_step(engine.optimizer),
        "scheduler": engine.scheduler.state_dict(),
        "optimizer_kind": optimizer_kind(engine.optimizer),
        "optimizer_fingerprint": _optimizer_fingerprint(state, engine),
    }
    dist_checkpointing.save(state, str(tmp), content_metadata=_OPT_METADATA)
    dist.barrier()
    if rank == 0:
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    dist.barrier()


def _saved_kind(path: Path, common: dict[str, Any]) -> str:
    """The optimizer kind a checkpoint was saved with: recorded since megarl saves plain-optimizer
    checkpoints that load; before, read from the optimizer's common state."""
    kind = saved_optimizer_kind(common)
    if kind is None:
        raise CheckpointError(f"{path}: the optimizer state's kind cannot be told from common.pt "
                              f"(optimizer entry: {sorted((common.get('optimizer') or {}).get('part0') or {})})")
    return kind


def load(engine: Any, path: str | os.PathLike[str]) -> None:
    """Collective. Loads model, optimizer and LR-schedule state saved at any layout."""

    path = Path(path)
    if not (path / "metadata.json").exists():
        raise CheckpointError(f"{path}: not a complete checkpoint (metadata.json missing)")
    common = dist_checkpointing.load_common_state_dict(str(path)) or {}
    if (common.get("megarl") or {}).get("model_only"):
        # Written by `megarl convert hf-to-mcore`: weights only, no optimizer or schedule state.
        from megarl.convert.engine_load import load_converted_weights

        load_converted_weights(engine, path)
        return
    info = common.get("megarl")
    if not info or info.get("format_version") != FORMAT_VERSION:
        found = info.get("format_version") if info else None
        raise CheckpointError(f"{path}: not a megarl engine checkpoint of format {FORMAT_VERSION} "
                              f"(found format {found})")
    kind = optimizer_kind(engine.optimizer)
    saved_kind = _saved_kind(path, common)
    if saved_kind != kind:
        raise CheckpointError(
            f"{path}: saved with {OPTIMIZER_KINDS.get(saved_kind, saved_kind)}, but this {engine.role} engine uses "
            f"{OPTIMIZER_KINDS[kind]}: their optimizer states are stored differently and one does not load into the "
            "other; resume with the checkpoint's setting (the parallel layout may differ)")
    # This run's settings, which the load must leave in place (see the module docstring).
    config_schedule = engine.scheduler.state_dict()
    config_groups = _param_group_settings(engine.optimizer)
    _init_adam_state(engine.optimizer)
    sharded = _sharded_state(engine, is_loading=True)
    loaded = dist_checkpointing.load(sharded, str(path))
    if info["family"] != engine.spec.family or info["role"] != engine.role:
        raise CheckpointError(
            f"{path}: saved for {info['family']}/{info['role']}, engine is {engine.spec.family}/{engine.role}"
        )
    result = unwrap(engine.ddp).load_state_dict(loaded["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks model tensors {missing[:5]} (it has {sorted(loaded['model'])[:5]})")

    for i, part in enumerate(_dist_optimizers(engine.optimizer)):
        opt_sd = dict(loaded["optimizer"][f"part{i}"])
        if kind != DISTRIBUTED:
            # Megatron's own load: Adam's moments (and bf16's fp32 main parameters, copied into the
            # optimizer's), its param groups, and `common_step` given to every parameter (a copy each).
            part.load_state_dict(opt_sd)
            continue
        param_state = opt_sd.pop("param_state")
        opt_sd.pop("param_state_sharding_type", None)
        part.load_state_dict(opt_sd)  # param groups (lr, wd, ...) only
        for state in part.optimizer.state.values():
            state.pop("step", None)
        part.load_parameter_state_from_fully_reshardable(param_state)
    saved_groups = _param_group_settings(engine.optimizer)
    _restore_param_group_settings(engine.optimizer, config_groups)
    _set_adam_step(engine.optimizer, int(info["adam_step"]))
    # Only the step is taken: the scheduler keeps this config's settings (optim.build_scheduler).
    engine.scheduler.load_state_dict(info["scheduler"])
    differ = changed_settings(config_schedule, info["scheduler"], config_groups, saved_groups)
    if differ and dist.get_rank() == 0:
        logger.warning("%s: resuming the %s engine with this run's optimizer settings, not the checkpoint's: %s; "
                       "the LR schedule continues from step %d under them (warmup and total in optimizer steps)",
                       path, engine.role, "; ".join(differ), engine.scheduler.num_steps)
    check_restored(path, info, engine, _optimizer_fingerprint(_sharded_state(engine, is_loading=False), engine))
    # Model params were overwritten by the checkpoint; the fp32 main params came from it too
    # (the fully-reshardable `param` or the plain bf16 `fp32_param` state; with plain fp32 they are
    # the model params), so nothing else to refresh.
    dist.barrier()
