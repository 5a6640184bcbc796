"""A resume takes the step from the checkpoint and the settings from the config: a finished run
extended with a higher total_training_steps and another lr continues on the new schedule at the
saved step (not at the old schedule's end, min_lr), and each changed setting is logged."""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import pytest

from _launch import run_distributed
from engine_helpers import make_batch, make_hf_model, pg_loss_fn, save_hf_model, scratch_dir

pytestmark = pytest.mark.distributed

BASE = dict(eps=1e-2, weight_decay=0.0, clip_grad=1.0, micro_batch_size=2, lr_schedule="cosine", min_lr=0.0,
            dtype="fp32")
FIRST = dict(BASE, lr=1e-3, total_training_steps=2)
EXTENDED = dict(BASE, lr=2e-3, total_training_steps=4, eps=1e-3)


def _engine(rank: int, world: int, port: int, hf_dir: str, cfg: dict) -> Any:
    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec

    layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout, EngineConfig(**cfg))
    engine.load_hf_weights(hf_dir)
    return engine


def _step_lr(engine: Any, batch: dict) -> float:
    """One optimizer step (the batch is one mini-batch); the LR it stepped with."""
    (lr,) = engine.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)["lr"]
    return lr


def _save_then_extend(rank: int, world: int, port: int, hf_dir: str, batches: list, ckpt_dir: str,
                      resume_cfgs: list[dict]) -> dict:
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("megarl.megatron.checkpoint").addHandler(Collect(level=logging.WARNING))
    first = _engine(rank, world, port, hf_dir, FIRST)
    first_lrs = [_step_lr(first, batches[i]) for i in range(2)]
    lr_at_end = float(first.optimizer.param_groups[0]["lr"])
    first.save_checkpoint(ckpt_dir)
    out: dict[str, Any] = {"first_lrs": first_lrs, "lr_at_end": lr_at_end, "resumes": []}
    for cfg in resume_cfgs:
        records.clear()
        resumed = _engine(rank, world, port, hf_dir, cfg)
        resumed.load_checkpoint(ckpt_dir)
        groups = resumed.optimizer.optimizer.param_groups
        out["resumes"].append({
            "num_steps": resumed.scheduler.num_steps,
            "lr_after_load": float(groups[0]["lr"]),
            "eps": {float(g["eps"]) for g in groups},
            "step_lrs": [_step_lr(resumed, batches[2 + i]) for i in range(2)],
            "warnings": list(records),
        })
    return out


def _cosine(lr: float, step: int, total: int) -> float:
    return 0.5 * (math.cos(math.pi * step / total) + 1.0) * lr


def test_extended_run_follows_the_new_schedule_from_the_saved_step() -> None:
    hf_dir = save_hf_model(make_hf_model("qwen3"))
    batches = [make_batch(seed=30 + i, batch=4) for i in range(4)]
    ckpt_dir = os.path.join(scratch_dir("megarl_sched_"), "step_2")
    res = run_distributed(_save_then_extend, 1, hf_dir, batches, ckpt_dir, [EXTENDED, FIRST])[0]
    assert res["first_lrs"] == pytest.approx([1e-3, _cosine(1e-3, 1, 2)])
    assert res["lr_at_end"] == 0.0  # the first run's schedule is over: min_lr

    extended, same = res["resumes"]
    assert extended["num_steps"] == 2
    # Step 2 of a cosine over 4 steps from 2e-3 (the old schedule would give min_lr, 0).
    assert extended["lr_after_load"] == pytest.approx(_cosine(2e-3, 2, 4))
    assert extended["step_lrs"] == pytest.approx([_cosine(2e-3, 2, 4), _cosine(2e-3, 3, 4)])
    assert extended["eps"] == {1e-3}
    (warning,) = extended["warnings"]
    assert "optim.lr 0.002 (checkpoint: 0.001)" in warning
    assert "optim.total_training_steps 4 (checkpoint: 2)" in warning
    assert "optim.eps 0.001 (checkpoint: 0.01)" in warning
    assert "continues from step 2" in warning
    for unchanged in ("optim.min_lr", "optim.lr_scheduler", "optim.lr_warmup_steps", "optim.weight_decay",
                      "optim.betas"):
        assert unchanged not in warning

    # The same config: the same schedule continues, nothing to warn about.
    assert same["num_steps"] == 2 and same["lr_after_load"] == 0.0 and same["step_lrs"] == [0.0, 0.0]
    assert same["eps"] == {1e-2} and same["warnings"] == []


def test_changed_settings_names_each_key() -> None:
    from megarl.megatron.checkpoint import changed_settings

    saved = dict(max_lr=1e-3, min_lr=1e-3, lr_warmup_steps=0, lr_decay_steps=2, lr_decay_style="constant",
                 start_wd=0.0, num_steps=2)
    now = dict(saved, max_lr=2e-3, min_lr=2e-3, lr_warmup_steps=1, num_steps=0)
    differ = changed_settings(now, saved, [{"betas": (0.9, 0.95), "eps": 1e-8}], [{"betas": [0.9, 0.999], "eps": 1e-8}])
    # A constant schedule's min_lr follows its lr: only lr is named.
    assert differ == ["optim.lr 0.002 (checkpoint: 0.001)", "optim.lr_warmup_steps 1 (checkpoint: 0)",
                      "optim.betas (0.9, 0.95) (checkpoint: (0.9, 0.999))"]
    assert changed_settings(saved, saved, [{"eps": 1e-8}], [{"eps": 1e-8}]) == []
