"""HF safetensors -> Megatron distributed checkpoint (torch_dist), one parameter at a time.

Peak memory is about one unsplit Megatron parameter of one layer (e.g. a fused QKV weight, or
the embedding): HF tensors are read when the writer asks for a chunk, fused, sliced and written.
The checkpoint holds model weights only and loads at any TP/PP (`load_converted_weights`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from megarl.convert.dcp_io import Chunk, write_checkpoint
from megarl.convert.hf_files import HFCheckpoint, copy_non_weight_files, expected_hf_shapes, read_config
from megarl.convert.layout import CheckpointTensor, family_architecture, plan_checkpoint, role_of_architecture
from megarl.dtypes import torch_dtype
from megarl.convert.output_dir import staged_output_dir
from megarl.convert.progress import Progress
from megarl.errors import ConfigError
from megarl.convert import HF_FILES_DIR  # noqa: F401 - also imported from here
from megarl.models.spec import ModelSpec
from megarl.models.weight_map import fuse, pad_vocab

CONVERTED_FORMAT = "megarl-converted-v1"
VALUE_HEAD = "score.weight"  # the scalar head of a HF *ForSequenceClassification model


@dataclass(frozen=True)
class ConversionResult:
    out_dir: Path
    num_tensors: int  # HF tensors read or written
    num_bytes: int  # bytes of weights written
    seconds: float
    notes: tuple[str, ...] = ()  # what the output lacks and why (printed by the CLI)


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    return torch_dtype(name, "--dtype")


class _FusedCache:
    """The last fused parameter, so that its TP chunks are made from one read."""

    def __init__(self) -> None:
        self.key: tuple[str, int] | None = None
        self.value: torch.Tensor | None = None

    def get(self, key: tuple[str, int], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.key != key:
            self.value = None  # free the previous one before making the next
            self.value, self.key = make(), key
        assert self.value is not None
        return self.value


def _fused_part(t: CheckpointTensor, layer: int, hf: HFCheckpoint, spec: ModelSpec, dtype: torch.dtype) -> torch.Tensor:
    """One layer's unsplit Megatron tensor (vocab padded), made from its HF tensors."""
    row = t.hf_names[layer]
    parts = hf.read(row)
    fused = fuse(t.entry, [parts[n].to(dtype) for n in row], spec)
    return pad_vocab(fused, t.part_shape[0]) if t.entry.vocab_padded else fused


def _chunk_data(t: CheckpointTensor, layer: int, start: int, length: int, hf: HFCheckpoint, spec: ModelSpec,
                dtype: torch.dtype, cache: _FusedCache) -> torch.Tensor:
    data = cache.get((t.key, layer), functools.partial(_fused_part, t, layer, hf, spec, dtype))
    if t.entry.tp_axis is not None:
        data = data.narrow(t.entry.tp_axis, start, length)
    # A view: the checkpoint writer copies a narrowed view itself before writing it.
    for _ in t.lead_shape:
        data = data.unsqueeze(0)
    return data


def _chunks_of(t: CheckpointTensor, hf: HFCheckpoint, spec: ModelSpec, tp: int, dtype: torch.dtype | None,
               cache: _FusedCache) -> list[Chunk]:
    """The chunks of one checkpoint tensor: per layer, and per TP rank along its split axis
    (a gate/up weight in 2*tp row blocks, as Megatron itself writes it)."""
    out_dtype = dtype or hf.tensors[t.hf_names[0][0]].dtype
    axis = t.entry.tp_axis
    blocks = 2 if t.entry.fusion == "gate_up" else 1  # row blocks per TP rank
    pieces = 1 if axis is None else tp * blocks
    if axis is not None and t.part_shape[axis] % pieces:
        # Equal pieces or none: the remainder would be in no chunk, and read back as garbage.
        raise ConfigError(
            f"{t.key}: dim {axis} of its per-layer shape {list(t.part_shape)} does not split into {pieces} equal "
            f"pieces (tp={tp}); valid tp: a divisor of {t.part_shape[axis] // blocks}"
        )
    length = t.part_shape[axis] // pieces if axis is not None else 0
    chunks = []
    for layer in range(len(t.hf_names)):
        for piece in range(pieces):
            offsets, sizes = [0] * len(t.part_shape), list(t.part_shape)
            if axis is not None:
                offsets[axis], sizes[axis] = piece * length, length
            lead = list(t.lead_index(layer))
            lead_size = [1] * len(lead)
            make = functools.partial(_chunk_data, t, layer, piece * length, length, hf, spec, out_dtype, cache)
            chunks.append(Chunk(t.key, t.global_shape, tuple(lead + offsets), tuple(lead_size + sizes), out_dtype, make))
    return chunks


def convert_hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1, ep: int = 1,
                        dtype: str | None = None, overwrite: bool = False, progress: bool = True,
                        family: str | None = None) -> ConversionResult:
    """Write `out_dir`, a Megatron distributed checkpoint of the HF model in `hf_dir`.

    `tp`/`pp` are checked against the model, set the vocabulary padding (padded for `tp`) and
    the on-disk chunking; the checkpoint loads at any layout. `dtype` (fp32/bf16/fp16) casts;
    by default tensors keep their HF dtype (bit-exact). Raises CheckpointError / ConfigError on
    bad input before anything is written; `out_dir` appears only when complete. `family` names
    the model spec family (`model.spec`, `--spec`) for a config whose model_type none lists; the
    checkpoint records it, and `convert_mcore_to_hf` and the engines read it back.
    """
    start = time.perf_counter()
    config = read_config(hf_dir)
    # From the file, so that its errors name it; an unknown architecture fails here.
    spec = ModelSpec.from_hf_config(Path(hf_dir) / "config.json", family=family)
    if ep != 1 and not spec.num_experts:
        raise ConfigError(f"--ep {ep}: the {spec.family} family has no experts (expert parallelism needs an MoE family)")
    spec.check_layout(tp, pp, ep)
    out_dtype = parse_dtype(dtype)
    hf = HFCheckpoint(hf_dir)
    architecture = (config.get("architectures") or [None])[0]
    if architecture is None:
        # transformers loads such a directory by its model_type; the weights tell a scalar-head
        # model (its `score`) from a causal LM.
        role = "value" if VALUE_HEAD in hf.tensors else "policy"
        architecture = family_architecture(spec, role)
    else:
        role = role_of_architecture(architecture)
    expected = expected_hf_shapes(config, architecture)
    if role == "value":
        _check_scalar_head(expected, config, Path(hf_dir) / "config.json", architecture)
    plan = plan_checkpoint(spec, role, expected, tp)
    needed = {n for t in plan for row in t.hf_names for n in row}
    uncovered = sorted(set(expected) - needed)
    if uncovered:
        raise ConfigError(f"model spec {spec.family}: its weight map does not cover HF tensors {uncovered[:5]}")
    hf.check({n: expected[n] for n in needed})

    cache = _FusedCache()
    chunks = [c for t in plan for c in _chunks_of(t, hf, spec, tp, out_dtype, cache)]
    total = sum(_nbytes(c) for c in chunks)
    bar = Progress("hf-to-mcore", total, len(chunks), enabled=progress, unit="chunks")
    common: dict[str, Any] = {"megarl": {
        "format": CONVERTED_FORMAT, "model_only": True, "family": spec.family, "role": role,
        "layout": {"tp": tp, "pp": pp, "ep": ep}, "vocab_size": spec.vocab_size, "hf_config": config,
    }}
    try:
        with staged_output_dir(out_dir, overwrite) as stage:
            write_checkpoint(stage, chunks, common, on_written=lambda c: bar.update(_nbytes(c)))
            (stage / HF_FILES_DIR).mkdir()
            copy_non_weight_files(hf_dir, stage / HF_FILES_DIR)
    finally:
        bar.close()
    return ConversionResult(Path(out_dir), len(needed), total, time.perf_counter() - start)


def _check_scalar_head(expected: dict[str, tuple[int, ...]], config: dict[str, Any], config_file: Path,
                       architecture: str) -> None:
    """A value or reward model's head is one scalar, `score.weight` [1, hidden_size] (the engine's
    scalar head, and what mcore-to-hf exports): a classifier of more labels is refused here, before a
    checkpoint is written that no engine and no export could use."""
    shape = expected.get(VALUE_HEAD)
    want = (1, int(config["hidden_size"]))
    if shape is not None and tuple(shape) != want:
        raise ConfigError(
            f"{config_file}: a {architecture} with num_labels = {shape[0]} ({VALUE_HEAD} of shape {list(shape)}); "
            f"a value or reward model has one label, {VALUE_HEAD} of shape {list(want)} (a model trained with "
            "num_labels = 1)"
        )


def _nbytes(c: Chunk) -> int:
    n = c.dtype.itemsize
    for s in c.sizes:
        n *= s
    return n
