"""Megatron distributed checkpoint -> HF safetensors, one layer's parameter at a time.

Works on checkpoints written by `convert_hf_to_mcore` and on the engine's (trainer's) actor and
critic checkpoints; the optimizer state in the latter is ignored. Peak memory is about one
layer's unsplit parameter plus one output shard (`max_shard_bytes`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megarl.convert.dcp_io import CheckpointReader
from megarl.convert.hf_files import INDEX_NAME, copy_non_weight_files, expected_hf_shapes, read_config
from megarl.convert.hf_to_mcore import HF_FILES_DIR, ConversionResult, parse_dtype
from megarl.convert.layout import CheckpointTensor, family_architecture, head_architecture, plan_checkpoint
from megarl.convert.output_dir import fsync_path, staged_output_dir
from megarl.convert.progress import Progress
from megarl.errors import CheckpointError, ConfigError
from megarl.models.spec import ModelSpec
from megarl.models.weight_map import unfuse

DEFAULT_MAX_SHARD_BYTES = 2 * 2**30


class ShardedSafetensorsWriter:
    """Collects tensors into shards of at most `max_shard_bytes` (one tensor may exceed it) and
    names them as transformers does: model.safetensors, or model-0000i-of-0000N + an index. Each
    file is flushed to disk (fsync) as soon as it is written."""

    def __init__(self, directory: Path, max_shard_bytes: int) -> None:
        self.dir, self.max = directory, max_shard_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + size > self.max:
            self._flush()
        self.current[name] = tensor.contiguous()
        self.current_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        fname = f".shard-{len(self.files):05d}.safetensors"
        save_file(self.current, str(self.dir / fname), metadata={"format": "pt"})
        fsync_path(self.dir / fname)
        self.files.append((fname, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def close(self) -> None:
        if self.current or not self.files:
            self._flush()
        if len(self.files) == 1:
            (self.dir / self.files[0][0]).rename(self.dir / "model.safetensors")
            return
        n = len(self.files)
        weight_map = {}
        for i, (fname, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.dir / fname).rename(self.dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2))
        fsync_path(self.dir / INDEX_NAME)


# HF config fields that fix a model's tensor shapes: a directory whose config differs from the
# checkpoint's stored one in any of them holds another model (an actor's initial_model/ above a
# critic started from a reward model of another size).
_SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "num_experts", "num_local_experts")


def _model_differences(config: dict[str, Any], stored: dict[str, Any], role: str) -> list[str]:
    """How `config` differs from a checkpoint's stored HF config in what fixes the tensors the
    checkpoint holds, as "field=value, stored stored_value". A field absent from either is not
    compared. tie_word_embeddings decides whether a policy has an lm_head of its own; a value model
    has none either way."""
    fields = [key for key in _SHAPE_FIELDS if key in config and key in stored and config[key] != stored[key]]
    diffs = [f"{key}={config[key]!r}, stored {stored[key]!r}" for key in fields]
    tied, stored_tied = (bool(c.get("tie_word_embeddings", False)) for c in (config, stored))
    if role == "policy" and tied != stored_tied:
        diffs.append(f"tie_word_embeddings={tied}, stored {stored_tied}")
    return diffs


def _same_model(directory: Path, info: dict[str, Any]) -> bool:
    """Whether `directory`'s config.json describes the model of a checkpoint whose common state is
    `info` (True when it stores no HF config to compare with)."""
    if not (directory / "config.json").is_file():
        return False
    stored = info.get("hf_config")
    if stored is None:
        return True
    return not _model_differences(read_config(directory), stored, info.get("role", "policy"))


def find_hf_source(ckpt_dir: Path, hf_config: str | Path | None, info: dict[str, Any] | None = None) -> Path | None:
    """Where the config and tokenizer files come from: `hf_config`; the checkpoint's own copy
    (converted checkpoints); the HF directory the engine was built from, recorded in the
    checkpoint's common state (`info["hf_dir"]`: a pretrained `model.path`, a critic's
    `critic.model_path`, the run's `initial_model/`); else `<run_dir>/initial_model` above a trainer
    checkpoint. A recorded or found directory counts only while its config describes the stored
    model (`info["hf_config"]`): a run directory moved since, or an actor's initial_model/ above a
    critic of another size, is passed over."""
    if hf_config is not None:
        return Path(hf_config)
    if (ckpt_dir / HF_FILES_DIR / "config.json").is_file():
        return ckpt_dir / HF_FILES_DIR
    info = info or {}
    candidates = [Path(info["hf_dir"])] if info.get("hf_dir") else []
    candidates += [parent / "initial_model" for parent in list(ckpt_dir.absolute().parents)[:4]]
    return next((path for path in candidates if _same_model(path, info)), None)


def checkpoint_model_spec(ckpt_dir: Path, info: dict[str, Any], source: Path | None,
                          config: dict[str, Any]) -> ModelSpec:
    """The model spec of a checkpoint's HF config (`checkpoint_hf_config`), for the family it was
    saved for; its `config_file` names where the config came from, so that errors say it."""
    if source is not None:
        return ModelSpec.from_hf_config(source / "config.json", family=info.get("family"))
    spec = ModelSpec.from_hf_config(config, family=info.get("family"))
    spec.config_file = f"the HF config stored in {ckpt_dir / 'common.pt'}"
    return spec


def checkpoint_hf_config(ckpt_dir: Path, info: dict[str, Any],
                         hf_config: str | Path | None) -> tuple[Path | None, dict[str, Any] | None]:
    """The HF directory (`find_hf_source`, None when there is none) and the HF config of a Megatron
    checkpoint: that directory's, else the copy the engine stored in its common state
    (`info["hf_config"]`); None when neither exists. An explicit `hf_config` must describe the
    stored model (ConfigError naming the fields that differ)."""
    source = find_hf_source(ckpt_dir, hf_config, info)
    if source is None:
        return None, (dict(info["hf_config"]) if "hf_config" in info else None)
    config = read_config(source)
    stored = info.get("hf_config")
    if hf_config is not None and stored is not None:
        diffs = _model_differences(config, stored, info.get("role", "policy"))
        if diffs:
            raise ConfigError(
                f"--hf-config {source / 'config.json'} describes another model than the one saved in {ckpt_dir} "
                f"(whose HF config is stored in its common.pt): {'; '.join(diffs)}; pass the HF directory of the "
                "saved model, or leave --hf-config out to use the stored config"
            )
    return source, config


def _output_config(config: dict[str, Any], role: str, spec: ModelSpec) -> dict[str, Any]:
    out = dict(config)
    arch = (config.get("architectures") or [None])[0]
    out["architectures"] = [head_architecture(arch, role) if arch else family_architecture(spec, role)]
    if role == "value":  # a scalar head: transformers' *ForSequenceClassification with one label
        out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return out


def _with_dtype(config: dict[str, Any], dtypes: set[torch.dtype]) -> dict[str, Any]:
    """`config` naming the dtype of the written floating-point tensors (when they share one): an
    export cast by --dtype, or of a checkpoint converted with one, must not keep the source's, or
    from_pretrained(dtype="auto") loads it in the wrong dtype. transformers 5 writes "dtype", older
    ones "torch_dtype": each key present is set, "dtype" when neither is."""
    if len(dtypes) != 1:
        return config
    name = str(next(iter(dtypes))).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    return {**config, **{k: name for k in keys}}


def _check_shapes(reader: CheckpointReader, plan: list[CheckpointTensor], vocab_size: int) -> None:
    for t in plan:
        got = tuple(reader.tensor_meta(t.key).size)
        want = t.global_shape
        vocab_dim = len(t.lead_shape)
        same = len(got) == len(want) and all(
            g == w or (t.entry.vocab_padded and d == vocab_dim and g >= vocab_size)
            for d, (g, w) in enumerate(zip(got, want))
        )
        if not same:
            raise CheckpointError(
                f"{reader.dir}: tensor {t.key} has shape {list(got)}, the model config needs {list(want)}"
                + (f" (vocabulary dim >= {vocab_size})" if t.entry.vocab_padded else "")
            )


def _check_all_read(reader: CheckpointReader, plan: list[CheckpointTensor], config: str) -> None:
    """Refuse an export that would drop model tensors of the checkpoint (an lm_head under a config
    that says tied embeddings): the optimizer state of a trainer checkpoint is not exported."""
    model_keys = {key for key, md in reader.metadata.state_dict_metadata.items()
                  if isinstance(md, TensorStorageMetadata) and not key.startswith("optimizer.")
                  and "_extra_state" not in key}
    unread = sorted(model_keys - {t.key for t in plan})
    if unread:
        raise CheckpointError(
            f"{reader.dir}: checkpoint tensors {unread[:5]}{' ...' if len(unread) > 5 else ''} have no place in the "
            f"HF model of {config}, so the export would drop them; that config describes another model than the "
            "one saved: pass --hf-config with the HF directory of the saved model"
        )


def convert_mcore_to_hf(ckpt_dir: str | Path, out_dir: str | Path, hf_config: str | Path | None = None,
                        dtype: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                        overwrite: bool = False, progress: bool = True) -> ConversionResult:
    """Write `out_dir`, a HF model directory (safetensors + config + tokenizer files).

    A policy becomes `<Family>ForCausalLM`; a critic (value role) becomes
    `<Family>ForSequenceClassification` with `num_labels=1` (its `score` is the value head).
    """
    start = time.perf_counter()
    ckpt = Path(ckpt_dir)
    reader = CheckpointReader(ckpt)  # a step directory, a run's root, a HF directory: refused, each by name
    info = reader.common().get("megarl") or {}
    source, config = checkpoint_hf_config(ckpt, info, hf_config)
    if config is None:
        raise ConfigError(
            f"{ckpt}: cannot find the HF config: pass --hf-config DIR (tried {ckpt / HF_FILES_DIR} and "
            f"initial_model/ in the run directories above it)"
        )
    spec = checkpoint_model_spec(ckpt, info, source, config)
    role = info.get("role", "policy")
    if role not in ("policy", "value"):
        raise CheckpointError(f"{ckpt}: role {role!r} cannot be exported (policy or value)")
    out_config = _output_config(config, role, spec)
    expected = expected_hf_shapes(out_config)
    plan = plan_checkpoint(spec, role, expected, tp=1)
    _check_shapes(reader, plan, spec.vocab_size)
    _check_all_read(reader, plan, spec.config_file)
    out_dtype = parse_dtype(dtype)
    role_spec = spec.for_role(role)

    total = sum(t.numel * reader.tensor_meta(t.key).properties.dtype.itemsize for t in plan)
    bar = Progress("mcore-to-hf", total, sum(len(t.hf_names) for t in plan), enabled=progress, unit="parameters")
    written: set[str] = set()
    written_dtypes: set[torch.dtype] = set()
    try:
        with staged_output_dir(out_dir, overwrite) as stage:
            writer = ShardedSafetensorsWriter(stage, max_shard_bytes)
            for t in plan:
                for layer, names in enumerate(t.hf_names):
                    if t.stacked:
                        lead = t.lead_index(layer)
                        part = reader.read(t.key, lead + (0,) * len(t.part_shape), (1,) * len(lead) + t.part_shape)
                        part = part.reshape(t.part_shape)
                    else:
                        part = reader.read(t.key)
                    if t.entry.vocab_padded:
                        part = part[: spec.vocab_size]
                    for name, tensor in zip(names, unfuse(t.entry, part, role_spec)):
                        tensor = tensor if out_dtype is None else tensor.to(out_dtype)
                        writer.add(name, tensor)
                        written.add(name)
                        if tensor.is_floating_point():
                            written_dtypes.add(tensor.dtype)
                    bar.update(part.numel() * part.element_size())
            missing = sorted(set(expected) - written)
            if missing:
                raise CheckpointError(f"{ckpt}: nothing in the checkpoint gives HF tensors {missing[:5]}")
            writer.close()
            out_config = _with_dtype(out_config, written_dtypes)
            if source is not None:
                copy_non_weight_files(source, stage)
            if source is None or out_config != config:  # a policy of the same dtype keeps its original config.json
                (stage / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")
    finally:
        bar.close()
    notes = () if source is not None else (
        f"{ckpt}: no HF directory found for this model (none recorded in the checkpoint or still there, no "
        "initial_model/ of the same model above it): config.json comes from the checkpoint, and no tokenizer or "
        "generation files were written; pass --hf-config DIR to copy them",)
    return ConversionResult(Path(out_dir), len(written), writer.total_bytes, time.perf_counter() - start, notes)
