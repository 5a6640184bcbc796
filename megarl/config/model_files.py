"""Checks of a HF model directory before any worker starts, without torch or transformers.

- the architecture: the config's `model_type` (or `architectures`) must be one a family YAML in
  model_specs/ lists, read here as plain YAML; the settings that family maps only for some values
  (its `requires:`) must have one of them, and the RoPE type must be one megarl computes;
- the weights: megarl's Megatron engine reads safetensors only (`model.safetensors`, or shards
  named by `model.safetensors.index.json`); each file's JSON header is read and every tensor's byte
  range checked against its shape, its dtype and the file's size, so a truncated or corrupt file is
  named before a worker tries to load it. No tensor data is read.

Every function returns problems as messages naming the config key and the file; [] means none.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import yaml

from megarl.errors import ConfigError

# The folder of the family YAMLs, for this light module and for megarl.models.spec (which imports
# torch for the weight map) alike.
SPEC_DIR_ENV = "MEGARL_MODEL_SPECS"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Bytes per element of each safetensors dtype.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def spec_dir() -> Path:
    """The folder holding the family YAMLs: `$MEGARL_MODEL_SPECS`, else model_specs/ of the checkout
    megarl runs from. An installed (non-editable) megarl has no checkout around it: set the variable."""
    env = os.environ.get(SPEC_DIR_ENV)
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "model_specs"
    if not path.is_dir():
        source = f"${SPEC_DIR_ENV}" if env else "the repository's model_specs/ (megarl installed outside a checkout?)"
        raise ConfigError(f"model specs folder {path} not found, from {source}: set {SPEC_DIR_ENV} to the folder "
                          "of the family YAMLs (model_specs/ of the megarl repository)")
    return path


def family_specs() -> dict[str, dict[str, Any]]:
    """Family name -> its YAML (`model_types`, `architectures`, ...; `_file`: the YAML's file name),
    for every file in model_specs/."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(spec_dir().glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        if isinstance(data, dict) and "family" in data:
            data.setdefault("_file", path.name)
            out[str(data["family"])] = data
    return out


def unsupported_settings(fam: dict[str, Any], hf: dict[str, Any]) -> list[str]:
    """The settings of the HF config `hf` that the family YAML `fam` maps only for some values (its
    `requires:` table) and that have another one, each as "HF config KEY=VALUE is not supported;
    valid: [...] (why)". [] when none."""
    out = []
    for key, rule in (fam.get("requires") or {}).items():
        found = hf.get(key, rule.get("default"))
        if found not in rule["allowed"]:
            out.append(f"HF config {key}={found!r} is not supported; valid: {rule['allowed']}"
                       + (f" ({rule['why']})" if rule.get("why") else ""))
    return out


# RoPE types megarl's Megatron model computes (`rope_type` of the HF config's rope_parameters /
# rope_scaling), and the keys Llama 3.x scaling reads (as transformers' `_compute_llama3_parameters`).
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_settings(hf: dict[str, Any], where: str) -> tuple[float, Optional[dict[str, float]]]:
    """(rotary base, Llama 3.x scaling or None) of the HF config `hf`, read as transformers reads
    them: `rope_parameters` (transformers 5) or else `rope_scaling`; the base from there or the
    top-level `rope_theta` (default 10000); with `rope_type: llama3` the dict of LLAMA3_ROPE_KEYS,
    `original_max_position_embeddings` taken from the top level first, then from the RoPE dict, then
    `max_position_embeddings`. Raises ConfigError naming the key (prefixed by `where`) for another
    RoPE type or a missing or out-of-range scaling value."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(key) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: HF config {key} = {rope!r}: expected an object")
    theta = next((v for v in (rope.get("rope_theta"), hf.get("rope_theta")) if v is not None), 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ConfigError(f"{where}: HF config {key}.rope_type = {rope_type!r} is not supported; "
                          f"valid: {list(ROPE_TYPES)}")
    values = {k: rope.get(k) for k in LLAMA3_ROPE_KEYS}
    for source in (hf.get("original_max_position_embeddings"), rope.get("original_max_position_embeddings"),
                   hf.get("max_position_embeddings")):
        if source is not None:
            values["original_max_position_embeddings"] = source
            break
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise ConfigError(f"{where}: HF config {key} with rope_type 'llama3' lacks {missing}; "
                          f"it needs {list(LLAMA3_ROPE_KEYS)}")
    bad = [f"{k} = {v!r}" for k, v in values.items()
           if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0]
    if not bad and values["high_freq_factor"] <= values["low_freq_factor"]:
        bad = [f"high_freq_factor = {values['high_freq_factor']!r} <= low_freq_factor = {values['low_freq_factor']!r}"]
    if bad:
        raise ConfigError(f"{where}: HF config {key} with rope_type 'llama3': {', '.join(bad)}; valid: positive "
                          f"numbers {list(LLAMA3_ROPE_KEYS)} with low_freq_factor < high_freq_factor")
    return float(theta), {k: float(v) for k, v in values.items()}


def architecture_problem(hf: dict[str, Any], where: str, family: Optional[str]) -> Optional[str]:
    """Why no model spec family fits the HF config `hf` (found in `where`), or None.

    `family` (`model.spec`) picks the family by name; otherwise the config's `model_type` or one of
    its `architectures` must be listed by a family (as `ModelSpec.from_hf_config` matches them).
    The family found must map the config's settings: its `requires:` table and the RoPE type
    (`unsupported_settings`, `rope_settings`; `ModelSpec` refuses the same in every worker).
    """
    families = family_specs()
    if family is not None:
        if family not in families:
            return f"model.spec = {family!r}: no such family in model_specs/; valid: {sorted(families)}"
        return _settings_problem(families[family], hf, where)
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    for fam in families.values():
        if model_type in (fam.get("model_types") or []) or any(a in (fam.get("architectures") or []) for a in archs):
            return _settings_problem(fam, hf, where)
    supported = ", ".join(f"{name} ({'/'.join(f.get('model_types') or [])})" for name, f in sorted(families.items()))
    return (f"{where}: model_type = {model_type!r} (architectures {archs}) is not supported; supported families: "
            f"{supported}; or name one with model.spec")


def _settings_problem(fam: dict[str, Any], hf: dict[str, Any], where: str) -> Optional[str]:
    problems = [f"{where}: model spec {fam['_file']}: {p}" for p in unsupported_settings(fam, hf)]
    try:
        rope_settings(hf, where)
    except ConfigError as err:
        problems.append(str(err))
    return "; ".join(problems) if problems else None


def safetensors_problem(path: Path) -> Optional[str]:
    """What is wrong with the safetensors file `path` (header, byte ranges, size), or None."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            return f"{path}: not a safetensors file ({size} bytes, no header length)"
        header_len = int.from_bytes(raw_len, "little")
        if header_len > min(size - 8, _MAX_HEADER):
            return f"{path}: truncated or not a safetensors file (header of {header_len} bytes, file of {size})"
        try:
            header = json.loads(f.read(header_len))
        except ValueError as err:
            return f"{path}: corrupt safetensors header ({err})"
    if not isinstance(header, dict):
        return f"{path}: corrupt safetensors header (not a JSON object)"
    data_len = size - 8 - header_len
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(v) for v in meta["data_offsets"])
            numel = 1
            for dim in meta["shape"]:
                numel *= int(dim)
            itemsize = DTYPE_BYTES[meta["dtype"]]
        except (KeyError, TypeError, ValueError):
            return f"{path}: corrupt safetensors header (tensor {name!r}: {meta!r})"
        if not 0 <= begin <= end or end - begin != numel * itemsize:
            return (f"{path}: corrupt safetensors header: tensor {name!r} of shape {meta['shape']} {meta['dtype']} "
                    f"needs {numel * itemsize} bytes, its range is [{begin}, {end})")
        if end > data_len:
            return (f"{path}: truncated: tensor {name!r} ends at data byte {end}, the file holds {data_len} data "
                    f"bytes ({size} bytes in all)")
    return None


def weights_problems(model_dir: Path, key: str) -> list[str]:
    """Problems of the safetensors weights in `model_dir` (`key` names the config key that points there)."""
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return [f"{key}: {index} is not a safetensors index (needs a 'weight_map' object): {err}"]
        absent = [name for name in files if not (model_dir / name).is_file()]
        if absent:
            return [f"{key}: {index} names shard file(s) {absent[:5]} that are missing "
                    f"({len(files) - len(absent)} of {len(files)} present)"]
    elif (model_dir / SINGLE_NAME).is_file():
        files = [SINGLE_NAME]
    else:
        found = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
        if found:
            return [f"{key} = {str(model_dir)!r}: no {SINGLE_NAME} or {INDEX_NAME}; megarl reads safetensors "
                    f"weights only (found {found[:5]}; save the model with save_pretrained(safe_serialization=True))"]
        return [f"{key} = {str(model_dir)!r}: no weights ({SINGLE_NAME} or {INDEX_NAME}); set "
                "model.init_from_scratch: true to start from random weights, or point to a saved model"]
    return [f"{key}: {problem}" for problem in (safetensors_problem(model_dir / name) for name in files) if problem]


def read_hf_config(model_dir: Path, key: str) -> tuple[Optional[dict[str, Any]], list[str]]:
    """(config.json of `model_dir`, problems): the config is None when it cannot be read."""
    if not model_dir.is_dir():
        return None, [f"{key} = {str(model_dir)!r}: no such directory"]
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return None, [f"{key} = {str(model_dir)!r}: no config.json there (a HF model directory needs one)"]
    try:
        config = json.loads(config_file.read_text())
    except ValueError as err:
        return None, [f"{key}: {config_file} is not valid JSON ({err})"]
    if not isinstance(config, dict):
        return None, [f"{key}: {config_file} is not a JSON object"]
    return config, []


def model_dir_problems(model_dir: Path, key: str, *, need_weights: bool, family: Optional[str]) -> list[str]:
    """A HF model directory a role starts from: config.json, a supported architecture and, when
    `need_weights`, complete safetensors weights."""
    config, problems = read_hf_config(model_dir, key)
    if config is None:
        return problems
    arch = architecture_problem(config, f"{key}: {model_dir / 'config.json'}", family)
    if arch:
        problems.append(arch)
    if need_weights:
        problems.extend(weights_problems(model_dir, key))
    return problems
