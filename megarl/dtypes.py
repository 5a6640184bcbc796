"""The one dtype vocabulary: config names (fp32, bf16, fp16) and their torch dtypes.

Configs, the training engine, the rollout engines and checkpoint conversion all read these tables;
the long torch names (float32, bfloat16, float16) are accepted as aliases of the short ones.
"""

from __future__ import annotations

import torch

from megarl.errors import ConfigError

TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ALIASES: dict[str, str] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
LONG_NAMES: dict[str, str] = {short: long for long, short in ALIASES.items()}


def short_name(name: str, where: str = "dtype") -> str:
    """`name` as one of fp32 | bf16 | fp16; ConfigError naming `where` otherwise."""
    short = ALIASES.get(name, name)
    if short not in TORCH_DTYPES:
        raise ConfigError(f"{where} = {name!r}: must be one of {sorted(TORCH_DTYPES)} (or {sorted(ALIASES)})")
    return short


def torch_dtype(name: str, where: str = "dtype") -> torch.dtype:
    return TORCH_DTYPES[short_name(name, where)]


def long_name(name: str, where: str = "dtype") -> str:
    """`name` as torch spells it (float32 | bfloat16 | float16), as HF and vLLM expect."""
    return LONG_NAMES[short_name(name, where)]
