"""HF checkpoint directories: safetensors (one file, or shards with an index), read lazily.

Everything is checked before anything is converted: the index names only files that exist, every
file is a complete safetensors file, every tensor the model needs is present with the shape that
transformers' own model class gives it. Tensors are then read one Megatron parameter at a time;
each read opens the file and closes it again, so memory-mapped pages do not pile up.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from megarl.errors import CheckpointError, ConfigError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files that hold weights; everything else in a HF model directory (config, tokenizer, chat
# template, generation config) is copied along with converted weights.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth",
                   ".ckpt", ".h5", ".msgpack", ".gguf")


@dataclass(frozen=True)
class TensorInfo:
    file: str  # file name inside the directory
    shape: tuple[int, ...]
    dtype: torch.dtype


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, checked against the file's size (truncation)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, header length missing)")
        header_len = int.from_bytes(raw_len, "little")
        if header_len > size - 8:
            raise CheckpointError(f"{path}: truncated safetensors file (header of {header_len} bytes, file {size})")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as err:
            raise CheckpointError(f"{path}: corrupt safetensors header ({err})") from err
    data_len = size - 8 - header_len
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if end > data_len:
        raise CheckpointError(
            f"{path}: truncated safetensors file: tensors need {end} data bytes, the file has {data_len}"
        )
    return header


class HFCheckpoint:
    """The weights of one HF model directory: names, shapes, dtypes and lazy reads."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"HF model directory not found: {self.dir}")
        self.tensors: dict[str, TensorInfo] = {}
        index = self.dir / INDEX_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map' object): {err}") from err
            bad = (f"a {type(weight_map).__name__}" if not isinstance(weight_map, dict) else
                   next((f"{{{n!r}: {f!r}, ...}}" for n, f in weight_map.items() if not isinstance(f, str)), None))
            if bad is not None:
                raise CheckpointError(
                    f"{index}: 'weight_map' is {bad}; a safetensors index maps each tensor name to the file that "
                    'holds it ({"model.embed_tokens.weight": "model-00001-of-00002.safetensors", ...})'
                )
            files = sorted(set(weight_map.values()))
            absent = [f for f in files if not (self.dir / f).is_file()]
            if absent:
                raise CheckpointError(
                    f"{self.dir}: shard file(s) {absent} listed in {INDEX_NAME} are missing "
                    f"({len(files) - len(absent)} of {len(files)} present)"
                )
            for fname in files:
                self._add_file(fname)
            misplaced = sorted(n for n, f in weight_map.items() if n not in self.tensors or self.tensors[n].file != f)
            if misplaced:
                raise CheckpointError(
                    f"{index}: tensors {misplaced[:5]} are not in the shard files the index names "
                    f"(a partial or mismatched shard)"
                )
        elif (self.dir / SINGLE_NAME).is_file():
            self._add_file(SINGLE_NAME)
        else:
            raise CheckpointError(
                f"{self.dir}: no {SINGLE_NAME} or {INDEX_NAME} (only safetensors weights are supported)"
            )

    def _add_file(self, fname: str) -> None:
        header = _read_header(self.dir / fname)
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(meta["dtype"])
            if dtype is None:
                raise CheckpointError(f"{self.dir / fname}: tensor {name} has unsupported dtype {meta['dtype']}")
            self.tensors[name] = TensorInfo(fname, tuple(int(s) for s in meta["shape"]), dtype)

    @property
    def total_bytes(self) -> int:
        return sum(_numel(t.shape) * t.dtype.itemsize for t in self.tensors.values())

    def check(self, expected: Mapping[str, tuple[int, ...]], optional: Iterable[str] = ()) -> None:
        """Every expected tensor present with its shape (optional ones may be absent)."""
        optional = set(optional)
        missing = sorted(n for n in expected if n not in self.tensors and n not in optional)
        if missing:
            raise CheckpointError(
                f"{self.dir}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                f"({len(missing)} of {len(expected)} the model needs)"
            )
        for name, shape in expected.items():
            info = self.tensors.get(name)
            if info is not None and info.shape != tuple(shape):
                raise CheckpointError(
                    f"{self.dir / info.file}: tensor {name} has shape {list(info.shape)}, "
                    f"the model config needs {list(shape)}"
                )

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read `names` (grouped by file; each file opened and closed again)."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for n in names:
            if n not in self.tensors:
                raise CheckpointError(f"{self.dir}: tensor {n} not found")
            by_file.setdefault(self.tensors[n].file, []).append(n)
        out: dict[str, torch.Tensor] = {}
        for fname, keys in by_file.items():
            with safe_open(str(self.dir / fname), framework="pt") as f:
                for k in keys:
                    out[k] = f.get_tensor(k)
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def read_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory}: no config.json (a HF model directory needs one)")
    try:
        config = json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: a HF config is a JSON object, got a {type(config).__name__}")
    return config


def expected_hf_shapes(hf_config: Mapping[str, Any], architecture: str | None = None) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from transformers' own model class built on the meta device.

    `architecture` defaults to the config's first `architectures` entry (e.g. Qwen2ForCausalLM).
    """
    import transformers

    cfg = dict(hf_config)
    arch = architecture or (cfg.get("architectures") or [None])[0]
    if arch is None:
        raise ConfigError("the HF config has no 'architectures' entry, the transformers class of the model "
                          '(e.g. "architectures": ["LlamaForCausalLM"])')
    model_cls = getattr(transformers, arch, None)
    if model_cls is None:
        raise ConfigError(f"transformers has no model class {arch!r} (config 'architectures')")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ConfigError("HF config has no 'model_type'")
    fields = {k: v for k, v in cfg.items() if k != "transformers_version"}
    if model_type in CONFIG_MAPPING:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    else:
        # A model_type transformers does not list (a renamed variant of a known model, converted with
        # --spec FAMILY): the architecture's own config class reads the same fields.
        config_cls = getattr(model_cls, "config_class", None)
        if not isinstance(config_cls, type):
            raise ConfigError(
                f"config.json: model_type {model_type!r} is not one transformers {transformers.__version__} knows, and "
                f"its model class {arch} names no config class to read the config with; set model_type to the one of "
                "the model it derives from, or name a transformers class of it in 'architectures'"
            )
        config = config_cls(**fields)
    with torch.device("meta"):
        model = model_cls(config)
    from megarl.models.weight_map import split_fused_experts

    shapes = split_fused_experts({n: tuple(p.shape) for n, p in model.state_dict().items()})
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def copy_non_weight_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy config, tokenizer and other non-weight files (not sub-directories) from src to dst."""
    copied = []
    for path in sorted(Path(src).iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, Path(dst) / path.name)
            copied.append(path.name)
    return copied
