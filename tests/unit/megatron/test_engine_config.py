"""Engine settings: typed fields, validation, the LR schedules, parallel layout arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.errors import ConfigError
from megarl.megatron.optim import EngineConfig, build_scheduler
from megarl.layout import ParallelLayout


def test_engine_features_are_typed_fields() -> None:
    cfg = EngineConfig(sequence_parallel=True, recompute_granularity="selective", lr_schedule="linear",
                       log_prob_micro_batch_size=16, micro_batch_size=2, betas=[0.9, 0.95], dtype="bf16")
    assert cfg.betas == (0.9, 0.95) and cfg.torch_dtype == torch.bfloat16
    assert cfg.sequence_parallel and cfg.recompute_granularity == "selective" and cfg.lr_schedule == "linear"
    assert cfg.forward_micro_batch_size == 16
    plain = EngineConfig(micro_batch_size=3)
    assert not plain.sequence_parallel and plain.recompute_granularity is None
    assert plain.forward_micro_batch_size == 3  # 0: micro_batch_size


@pytest.mark.parametrize("bad,match", [
    ({"lr_schedule": "step"}, "lr_schedule"), ({"dtype": "fp8"}, "dtype"),
    ({"micro_batch_size": 0}, "micro_batch_size"),
    ({"recompute_granularity": "block"}, "recompute_granularity.*'full', 'selective'"),
    ({"log_prob_micro_batch_size": -1}, "log_prob_micro_batch_size"),
])
def test_invalid_settings_name_the_key(bad: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**bad)


def test_a_frozen_engine_config_sums_no_gradients() -> None:
    assert EngineConfig().trained and not EngineConfig(trained=False).trained
    with pytest.raises(ConfigError, match="host_grad_reduce=True with trained=False"):
        EngineConfig(trained=False, host_grad_reduce=True)


@pytest.mark.parametrize("dtype", ["fp16", "float16"])
def test_fp16_is_refused_with_the_reason(dtype: str) -> None:
    with pytest.raises(ConfigError, match="fp16 training needs loss scaling.*'bf16'"):
        EngineConfig(dtype=dtype)


@pytest.mark.parametrize("style", ["constant", "cosine", "linear"])
def test_lr_schedule_per_step(style: str) -> None:
    """Warmup 0 -> lr over 3 steps, then decay to min_lr at step 7 (total_training_steps), then min_lr."""
    cfg = EngineConfig(lr=1.0, min_lr=0.2, lr_schedule=style, lr_warmup_steps=3, total_training_steps=7,
                       weight_decay=0.0)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # the scheduler sets its param_groups' lr
    scheduler = build_scheduler(cfg, opt)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        scheduler.step(increment=1)
    decay = [s / 4 for s in range(5)]  # fraction of the decay done at steps 3..7
    after = {"constant": [1.0] * 5, "linear": [1.0 - 0.8 * d for d in decay],
             "cosine": [0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * d)) for d in decay]}[style]
    tail = [1.0, 1.0] if style == "constant" else [0.2, 0.2]
    assert lrs == pytest.approx([0.0, 1 / 3, 2 / 3] + after + tail)


def test_layout_resolves_dp_and_checks_divisibility() -> None:
    assert ParallelLayout(tp=2, pp=2).resolved(8).dp == 2
    with pytest.raises(ConfigError, match="not divisible"):
        ParallelLayout(tp=3).resolved(4)
    with pytest.raises(ConfigError, match="dp=3"):
        ParallelLayout(tp=2, dp=3).resolved(4)
