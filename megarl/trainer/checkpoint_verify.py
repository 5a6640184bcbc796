"""Is a checkpoint complete? Checked before anyone relies on it: `megarl checkpoint verify DIR`, and
the trainer before it resumes (before Ray and the workers start, see `select_resume`).

What a directory is, is read from what it holds:
- a trainer checkpoint (`global_step_N/`: `COMPLETE` marker, `trainer_state.pt`, `config.yaml`, one
  engine directory per trained role, `actor/` and maybe `critic/`);
- a checkpoint root (`latest_checkpointed_iteration.txt`, `global_step_*`): the checkpoint the
  tracker file names (without it, the complete checkpoint committed last, which a resume would take);
- an engine checkpoint (Megatron `torch_dist`: `metadata.json`, `.metadata`, `__*.distcp`,
  `common.pt`), written by the trainer or by `megarl convert hf-to-mcore`;
- a HF model directory (`config.json`, `model.safetensors` or shards with an index).

Checked: every tensor the model spec expects (every layer and expert, from the HF config the
checkpoint carries or the run's `initial_model/`) with its shape and every element stored; for a
trainer's engine, Adam's `exp_avg`/`exp_avg_sq` and the fp32 main parameter for every parameter (the
distributed optimizer's `param`, the plain bf16 optimizer's `fp32_param`; with the plain fp32
optimizer the model tensor is the main parameter), its step counter and LR-schedule state; every
shard file present and as long as the byte ranges the index gives it; the size and CRC-32 of every
file against the manifest written when the checkpoint was committed; the driver state (step,
data-loader position, KL controller, RNG). Every problem is reported at once,
naming the file and the tensor.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from megarl.config import critic_enabled
from megarl.convert.dcp_io import ENGINE_DIRS
from megarl.convert.hf_files import INDEX_NAME, SINGLE_NAME, HFCheckpoint, expected_hf_shapes, read_config
from megarl.convert.layout import CheckpointTensor, family_architecture, head_architecture, plan_checkpoint
from megarl.convert.mcore_to_hf import checkpoint_hf_config, checkpoint_model_spec
from megarl.errors import CheckpointError, MegarlError
from megarl.megatron.checkpoint_format import FORMAT_VERSION, MAIN_PARAM_STATE, OPTIMIZER_KINDS, PLAIN_FP32, saved_optimizer_kind
from megarl.trainer.checkpoint_dirs import COMPLETE_MARKER, CheckpointDirs, LATEST_FILE, STATE_FILE, STEP_DIR_PREFIX, crc32_of_file, read_marker

logger = logging.getLogger(__name__)
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")

def _param_groups(common: dict[str, Any], kind: Optional[str]) -> Any:
    part = (common.get("optimizer") or {}).get("part0") or {}
    return (part if kind == PLAIN_FP32 else part.get("optimizer") or {}).get("param_groups")


@dataclass
class VerifyReport:
    """The outcome of one check: `problems` make the checkpoint unusable, `notes` say what was
    checked or could not be."""

    path: Path
    kind: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def merge(self, other: "VerifyReport") -> None:
        self.problems += other.problems
        self.notes += other.notes

    def raise_if_bad(self) -> None:
        if self.problems:
            raise CheckpointError(self.message())

    def message(self) -> str:
        head = f"{self.path}: {self.kind} checkpoint is {'complete' if self.ok else 'NOT usable'}"
        lines = [head] + [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


# ---------------------------------------------------------------- engine (torch_dist) checkpoints
def _expected_plan(ckpt: Path, info: dict[str, Any], hf_config: Optional[Path],
                   report: VerifyReport) -> Optional[list[CheckpointTensor]]:
    """The model tensors the spec expects, or None (noted) when no HF config can be found."""
    source, config = checkpoint_hf_config(ckpt, info, hf_config)
    if config is None:
        report.notes.append(f"{ckpt}: no HF config found (none stored in common.pt, no initial_model/ above, no "
                            "--hf-config): stored tensors checked, not the list the model spec expects")
        return None
    role = info.get("role", "policy")
    spec = checkpoint_model_spec(ckpt, info, source, config)
    arch = (config.get("architectures") or [None])[0]
    shapes_config = dict(config)
    if role == "value":  # the value head is a one-label sequence classifier's `score`
        shapes_config.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    expected = expected_hf_shapes(shapes_config,
                                  head_architecture(arch, role) if arch else family_architecture(spec, role))
    return plan_checkpoint(spec, role, expected, tp=1)


def _uncovered_positions(md: TensorStorageMetadata, lead_dims: int) -> tuple[int, list[tuple[int, ...]]]:
    """Elements of the tensor no chunk stores, and the stacking positions (layer[, expert]) they fall in."""
    size = tuple(md.size)
    total = math.prod(size)
    stored = sum(math.prod(c.sizes) for c in md.chunks)
    if stored >= total or lead_dims == 0:
        return max(total - stored, 0), []
    lead = size[:lead_dims]
    part = math.prod(size[lead_dims:])
    covered = torch.zeros(lead, dtype=torch.int64)
    for c in md.chunks:
        box = covered
        for d in range(lead_dims):
            box = box.narrow(d, c.offsets[d], c.sizes[d])
        box += math.prod(c.sizes[lead_dims:])
    missing = [tuple(int(i) for i in idx) for idx in (covered < part).nonzero().tolist()]
    return total - stored, missing


def _position_name(pos: tuple[int, ...]) -> str:
    names = ("layer", "expert")
    return " ".join(f"{names[i] if i < len(names) else 'dim' + str(i)} {v}" for i, v in enumerate(pos))


def _check_storage(ckpt: Path, metadata: Any, report: VerifyReport) -> None:
    """Every chunk has a storage entry, every shard file exists and holds the byte ranges given to it."""
    by_file: dict[str, list[tuple[str, int]]] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index.fqn, info.offset + info.length))
    for name, items in sorted(by_file.items()):
        path = ckpt / name
        tensors = sorted({fqn for fqn, _ in items if "_extra_state" not in fqn})
        shown = f"{tensors[:4]}{' ...' if len(tensors) > 4 else ''} ({len(tensors)} tensors)"
        if not path.is_file():
            report.problems.append(f"{path}: shard file missing; it holds {shown}")
            continue
        size = path.stat().st_size
        need = max(end for _, end in items)
        if size < need:
            cut = sorted({fqn for fqn, end in items if end > size and "_extra_state" not in fqn})
            report.problems.append(f"{path}: truncated shard file ({size} bytes, its index needs {need}); "
                                   f"unreadable tensors: {cut[:4]}{' ...' if len(cut) > 4 else ''} ({len(cut)})")
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        for c in md.chunks:
            if MetadataIndex(key, c.offsets) not in metadata.storage_data:
                report.problems.append(f"{ckpt}: tensor {key} chunk at {list(c.offsets)} has no storage entry")
                break


def _check_tensor(ckpt: Path, metadata: Any, key: str, shape: Optional[tuple[int, ...]], lead_dims: int,
                  vocab: Optional[tuple[int, int]], report: VerifyReport, what: str = "tensor") -> bool:
    md = metadata.state_dict_metadata.get(key)
    if not isinstance(md, TensorStorageMetadata):
        report.problems.append(f"{ckpt}: {what} {key} is missing")
        return False
    got = tuple(md.size)
    if shape is not None:
        same = len(got) == len(shape) and all(
            g == w or (vocab is not None and d == vocab[0] and g >= vocab[1]) for d, (g, w) in enumerate(zip(got, shape)))
        if not same:
            report.problems.append(f"{ckpt}: {what} {key} has shape {list(got)}, the model spec needs {list(shape)}")
            return False
    absent, positions = _uncovered_positions(md, lead_dims)
    if absent:
        where = f" (missing {', '.join(_position_name(p) for p in positions[:6])}{' ...' if len(positions) > 6 else ''})" \
            if positions else ""
        report.problems.append(f"{ckpt}: {what} {key} stores {math.prod(got) - absent} of {math.prod(got)} "
                               f"elements{where}")
        return False
    return True


def verify_engine_checkpoint(ckpt: Union[str, Path], hf_config: Optional[Union[str, Path]] = None) -> VerifyReport:
    """Check a Megatron `torch_dist` checkpoint written by the trainer's engine or by `convert hf-to-mcore`."""
    ckpt = Path(ckpt)
    report = VerifyReport(ckpt, "engine")
    marker = ckpt / "metadata.json"
    if not marker.is_file():
        report.problems.append(f"{marker}: missing (written last by a finished save; the save did not finish)")
        return report
    try:
        backend = json.loads(marker.read_text()).get("sharded_backend")
    except ValueError as err:
        report.problems.append(f"{marker}: not valid JSON ({err})")
        return report
    if backend != "torch_dist":
        report.problems.append(f"{marker}: sharded_backend={backend!r}, only 'torch_dist' is supported")
        return report
    try:
        metadata = FileSystemReader(str(ckpt)).read_metadata()
    except Exception as err:  # a damaged index: any unpickling error
        report.problems.append(f"{ckpt / '.metadata'}: unreadable ({type(err).__name__}: {err})")
        return report
    try:
        common = torch.load(ckpt / "common.pt", map_location="cpu", weights_only=False) or {}
    except Exception as err:  # missing or damaged pickle
        report.problems.append(f"{ckpt / 'common.pt'}: unreadable ({type(err).__name__}: {err})")
        return report
    info = common.get("megarl") or {}
    model_only = bool(info.get("model_only"))
    report.kind = "converted engine" if model_only else "trainer engine"
    _check_storage(ckpt, metadata, report)

    try:
        plan = _expected_plan(ckpt, info, None if hf_config is None else Path(hf_config), report)
    except MegarlError as err:
        report.problems.append(f"{ckpt}: cannot derive the expected tensors: {err}")
        plan = None
    tensor_keys = [k for k, md in metadata.state_dict_metadata.items()
                   if isinstance(md, TensorStorageMetadata) and not k.startswith("optimizer.")]
    if plan is not None:
        expected = [(t.key, t.global_shape, len(t.lead_shape),
                     (len(t.lead_shape), t.global_shape[len(t.lead_shape)]) if t.entry.vocab_padded else None)
                    for t in plan]
        unexpected = sorted(set(tensor_keys) - {t.key for t in plan})
        if unexpected:
            report.notes.append(f"{ckpt}: tensors the model spec does not list: {unexpected[:4]}")
    else:
        expected = [(k, None, 0, None) for k in tensor_keys]
    complete_keys = [key for key, shape, lead, vocab in expected
                     if _check_tensor(ckpt, metadata, key, shape, lead, vocab, report)]
    report.notes.append(f"{ckpt}: {len(complete_keys)} of {len(expected)} model tensors complete")

    if model_only:
        return report
    if info.get("format_version") != FORMAT_VERSION:
        report.problems.append(f"{ckpt / 'common.pt'}: megarl format {info.get('format_version')}, expected "
                               f"{FORMAT_VERSION}")
        return report
    kind = saved_optimizer_kind(common)
    if kind not in MAIN_PARAM_STATE:
        report.problems.append(f"{ckpt / 'common.pt'}: optimizer of unknown kind {kind!r} (known: "
                               f"{sorted(MAIN_PARAM_STATE)}); its state cannot be checked")
        return report
    states = ADAM_MOMENTS + ((MAIN_PARAM_STATE[kind],) if MAIN_PARAM_STATE[kind] else ())
    for key, shape, lead, vocab in expected:
        for state in states:
            _check_tensor(ckpt, metadata, f"optimizer.state.{state}.{key}", shape, lead, vocab, report,
                          what="optimizer state")
    step = info.get("adam_step")
    if not isinstance(step, int) or step < 0:
        report.problems.append(f"{ckpt / 'common.pt'}: Adam step count {step!r} (expected an integer >= 0)")
    sched = info.get("scheduler")
    if not isinstance(sched, dict) or not isinstance(sched.get("num_steps"), int):
        report.problems.append(f"{ckpt / 'common.pt'}: learning-rate schedule state missing or without num_steps")
    elif isinstance(step, int) and step > 0 and sched["num_steps"] <= 0:
        report.problems.append(f"{ckpt / 'common.pt'}: Adam took {step} steps but the LR schedule is at step "
                               f"{sched['num_steps']}")
    groups = _param_groups(common, kind)
    if not groups:
        report.problems.append(f"{ckpt / 'common.pt'}: optimizer parameter groups missing")
    report.notes.append(f"{ckpt}: optimizer state of {OPTIMIZER_KINDS[kind]} for {len(complete_keys)} "
                        f"parameters, Adam step {step}")
    return report


# ---------------------------------------------------------------- HF model directories
def verify_hf_checkpoint(directory: Union[str, Path]) -> VerifyReport:
    """Every tensor transformers' model class has, with its shape, in complete safetensors files."""
    directory = Path(directory)
    report = VerifyReport(directory, "HF")
    try:
        config = read_config(directory)
        ckpt = HFCheckpoint(directory)
        ckpt.check(expected_hf_shapes(config))
    except MegarlError as err:
        report.problems.append(str(err))
        return report
    report.notes.append(f"{directory}: {len(ckpt.tensors)} tensors, {ckpt.total_bytes / 2**20:.1f} MiB")
    return report


# ---------------------------------------------------------------- trainer checkpoints
def _check_manifest(step_dir: Path, marker: dict[str, Any], checksums: bool, report: VerifyReport) -> None:
    files = marker.get("files")
    if files is None:
        report.notes.append(f"{step_dir / COMPLETE_MARKER}: no file manifest (written by an older megarl): "
                            "sizes and checksums not checked")
        return
    for rel, want in sorted(files.items()):
        path = step_dir / rel
        if not path.is_file():
            report.problems.append(f"{path}: missing (listed in {COMPLETE_MARKER})")
            continue
        size = path.stat().st_size
        if size != want["size"]:
            report.problems.append(f"{path}: {size} bytes, {want['size']} when saved (truncated or replaced)")
        elif checksums and crc32_of_file(path) != want["crc32"]:
            report.problems.append(f"{path}: contents changed since the save (CRC-32 differs; corrupted)")
    report.notes.append(f"{step_dir}: {len(files)} files against the manifest"
                        + (" (sizes and CRC-32)" if checksums else " (sizes)"))


def _check_driver_state(step_dir: Path, step: int, report: VerifyReport) -> None:
    path = step_dir / STATE_FILE
    if not path.is_file():
        report.problems.append(f"{path}: missing (driver state: step, data-loader position, KL controller, RNG)")
        return
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # truncated or damaged pickle
        report.problems.append(f"{path}: unreadable ({type(err).__name__}: {err})")
        return
    need = {
        "global_step": lambda s: s["global_step"],
        "weights_version": lambda s: s["weights_version"],
        "dataloader.sampler.epoch": lambda s: s["dataloader"]["sampler"]["epoch"],
        "dataloader.sampler.position": lambda s: s["dataloader"]["sampler"]["position"],
        "kl_ctrl.value": lambda s: s["kl_ctrl"]["value"],
        "rng.python": lambda s: s["rng"]["python"],
        "rng.numpy": lambda s: s["rng"]["numpy"],
        "rng.torch_cpu": lambda s: s["rng"]["torch_cpu"],
    }
    for name, get in need.items():
        try:
            get(state)
        except (KeyError, TypeError):
            report.problems.append(f"{path}: {name} missing")
    if isinstance(state, dict) and state.get("global_step") not in (None, step):
        report.problems.append(f"{path}: global_step {state['global_step']}, the checkpoint is of step {step}")


def _expected_engines(step_dir: Path, report: VerifyReport) -> list[str]:
    engines = ["actor"]
    config = step_dir / "config.yaml"
    if not config.is_file():
        report.problems.append(f"{config}: missing (the run's resolved config)")
    else:
        try:
            if critic_enabled(OmegaConf.load(config)):
                engines.append("critic")
        except Exception as err:  # a damaged YAML
            report.problems.append(f"{config}: unreadable ({type(err).__name__}: {err})")
    engines += [d for d in ENGINE_DIRS if d not in engines and (step_dir / d).is_dir()]
    return engines


def verify_trainer_checkpoint(step_dir: Union[str, Path], checksums: bool = True,
                              hf_config: Optional[Union[str, Path]] = None) -> VerifyReport:
    """Check one `global_step_N` directory: marker and manifest, driver state, every engine."""
    step_dir = Path(step_dir)
    report = VerifyReport(step_dir, "trainer")
    try:
        marker = read_marker(step_dir)
    except CheckpointError as err:
        report.problems.append(str(err))
        return report
    step = marker["step"]
    if step_dir.name.startswith(STEP_DIR_PREFIX) and step_dir.name != f"{STEP_DIR_PREFIX}{step}":
        report.problems.append(f"{step_dir / COMPLETE_MARKER}: marks step {step}, the directory is {step_dir.name}")
    _check_manifest(step_dir, json.loads((step_dir / COMPLETE_MARKER).read_text()), checksums, report)
    _check_driver_state(step_dir, step, report)
    for name in _expected_engines(step_dir, report):
        if not (step_dir / name).is_dir():
            report.problems.append(f"{step_dir / name}: missing (the run trains {name})")
            continue
        report.merge(verify_engine_checkpoint(step_dir / name, hf_config))
    return report


def tracked_step(root: Path) -> Optional[int]:
    """The step `latest_checkpointed_iteration.txt` names, or None without one."""
    latest = root / LATEST_FILE
    if not latest.is_file():
        return None
    text = latest.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{latest}: {text!r} is not a step number")
    return int(text)


def verify_checkpoint(path: Union[str, Path], checksums: bool = True,
                      hf_config: Optional[Union[str, Path]] = None) -> VerifyReport:
    """Check whatever checkpoint `path` holds (see the module docstring for the kinds)."""
    path = Path(path)
    if not path.is_dir():
        report = VerifyReport(path, "unknown")
        report.problems.append(f"{path}: not a directory")
        return report
    if (path / COMPLETE_MARKER).exists() or (path / STATE_FILE).exists():
        return verify_trainer_checkpoint(path, checksums, hf_config)
    if (path / "metadata.json").exists() or (path / ".metadata").exists():
        return verify_engine_checkpoint(path, hf_config)
    if (path / SINGLE_NAME).exists() or (path / INDEX_NAME).exists():
        return verify_hf_checkpoint(path)
    steps = sorted(int(p.name[len(STEP_DIR_PREFIX):]) for p in path.glob(STEP_DIR_PREFIX + "*")
                   if p.name[len(STEP_DIR_PREFIX):].isdigit())
    if (path / LATEST_FILE).exists() or steps:
        step = tracked_step(path)
        which = f"the one {LATEST_FILE} names"
        if step is None:
            # Without the latest file, the complete checkpoint committed last (what a resume takes), not the
            # highest step: an abandoned continuation's higher steps can remain after resuming an older one.
            last = CheckpointDirs(path).latest()
            step, which = (last[0], "the complete one committed last (no latest file)") if last is not None \
                else (steps[-1], "the highest step (no latest file and no complete checkpoint)")
        report = verify_trainer_checkpoint(path / f"{STEP_DIR_PREFIX}{step}", checksums, hf_config)
        report.notes.insert(0, f"{path}: checkpoint root; checked the checkpoint of step {step}, {which}")
        return report
    report = VerifyReport(path, "unknown")
    report.problems.append(
        f"{path}: not a checkpoint: expected a trainer checkpoint ({COMPLETE_MARKER}, {STATE_FILE}), a checkpoint root "
        f"({LATEST_FILE}), a Megatron checkpoint (metadata.json) or a HF model ({SINGLE_NAME} or {INDEX_NAME})")
    return report


def verified_steps(root: Path, steps: Iterable[int], checksums: bool = True) -> Iterable[tuple[int, VerifyReport]]:
    """Reports for `global_step_<s>` under `root`, in the given order (lazily: stop at the first good one)."""
    for s in steps:
        yield s, verify_trainer_checkpoint(root / f"{STEP_DIR_PREFIX}{s}", checksums)
