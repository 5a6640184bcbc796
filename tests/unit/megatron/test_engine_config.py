"""Engine settings: flat and verl-style keys, validation, parallel layout arithmetic."""

from __future__ import annotations

import pytest
import torch

from megarl.errors import ConfigError
from megarl.megatron.optim import EngineConfig
from megarl.layout import ParallelLayout


def test_verl_style_optim_section() -> None:
    cfg = EngineConfig.from_mapping({
        "optim": {"lr": 2e-6, "betas": [0.9, 0.95], "weight_decay": 0.1, "clip_grad": 0.5,
                  "warmup_style": "cosine", "lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.1,
                  "total_training_steps": 50, "min_lr_ratio": 0.1},
        "micro_batch_size": 2, "dtype": "bf16", "role": "value",
    })
    assert cfg.lr == 2e-6 and cfg.betas == (0.9, 0.95) and cfg.clip_grad == 0.5
    assert cfg.lr_schedule == "cosine" and cfg.lr_warmup_steps == 5 and cfg.min_lr == pytest.approx(2e-7)
    assert cfg.torch_dtype == torch.bfloat16 and cfg.role == "value"


@pytest.mark.parametrize("bad,match", [
    ({"lr_schedule": "linear"}, "lr_schedule"), ({"dtype": "fp8"}, "dtype"),
    ({"micro_batch_size": 0}, "micro_batch_size"), ({"learning_rate": 1.0}, "unknown keys"),
])
def test_invalid_settings_name_the_key(bad: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_mapping(bad)


def test_layout_resolves_dp_and_checks_divisibility() -> None:
    assert ParallelLayout(tp=2, pp=2).resolved(8).dp == 2
    with pytest.raises(ConfigError, match="not divisible"):
        ParallelLayout(tp=3).resolved(4)
    with pytest.raises(ConfigError, match="dp=3"):
        ParallelLayout(tp=2, dp=3).resolved(4)
