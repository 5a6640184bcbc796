"""A load is checked against what the save recorded: the optimizer-state fingerprint taken at save
(every element once, at any layout) must come back after loading at another layout, be non-trivial
after training, and a checkpoint whose recorded state differs from what loads is refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from _launch import run_distributed
from engine_helpers import make_batch, make_hf_model, pg_loss_fn, save_hf_model

pytestmark = pytest.mark.distributed

CFG = dict(lr=1e-2, eps=1e-2, weight_decay=0.0, clip_grad=1.0, micro_batch_size=2, lr_schedule="cosine",
           lr_warmup_steps=1, total_training_steps=4, min_lr=1e-3)


def _engine(rank: int, world: int, port: int, hf_dir: str, layout_kw: dict) -> Any:
    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec

    layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**layout_kw))
    engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout, EngineConfig(**CFG, dtype="fp32"))
    engine.load_hf_weights(hf_dir)
    return engine


def _save_load(rank: int, world: int, port: int, hf_dir: str, base: str) -> dict[str, Any]:
    import torch.distributed as dist

    from megarl.errors import CheckpointError

    engine = _engine(rank, world, port, hf_dir, dict(tp=2))
    for seed in (1, 2):
        r = engine.ranks
        batch = {k: v.chunk(r.dp_size)[r.dp_rank] for k, v in make_batch(seed=seed, batch=4).items()}
        engine.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)
    good, tampered = Path(base) / "good", Path(base) / "tampered"
    engine.save_checkpoint(str(good))
    if rank == 0:  # a checkpoint whose recorded optimizer state is not what its shards hold
        shutil.copytree(good, tampered)
        common = torch.load(tampered / "common.pt", weights_only=False)
        common["megarl"]["optimizer_fingerprint"]["exp_avg_sq_sum"] *= 1.5
        torch.save(common, tampered / "common.pt")
    dist.barrier()
    resumed = _engine(rank, world, port, hf_dir, dict(dp=2))  # another layout
    resumed.load_checkpoint(str(good))
    error = None
    try:
        _engine(rank, world, port, hf_dir, dict(dp=2)).load_checkpoint(str(tampered))
    except CheckpointError as err:
        error = str(err)
    recorded = torch.load(good / "common.pt", weights_only=False)["megarl"]
    return {"recorded": recorded, "error": error, "lr": resumed.optimizer.param_groups[0]["lr"],
            "lr_saved": engine.optimizer.param_groups[0]["lr"]}


def test_load_matches_the_recorded_state_and_refuses_a_mismatch(tmp_path: Path) -> None:
    model = make_hf_model("qwen3")
    hf_dir = save_hf_model(model)
    results = run_distributed(_save_load, 2, hf_dir, str(tmp_path))
    recorded = results[0]["recorded"]
    fp = recorded["optimizer_fingerprint"]
    # Every parameter element once (the real vocabulary rows, not the TP padding), whatever the layout.
    assert fp["elements"] == sum(p.numel() for p in model.parameters())
    assert fp["exp_avg_sq_sum"] > 0 and fp["exp_avg_abs_sum"] > 0 and fp["param_abs_sum"] > 0
    assert recorded["adam_step"] == 2 and recorded["scheduler"]["num_steps"] > 0
    for r in results:
        assert r["lr"] == r["lr_saved"]  # the schedule continues where it was
        err = r["error"]
        assert err is not None, "a checkpoint whose state differs from its record loaded silently"
        assert "tampered: the load did not restore the saved state" in err
        assert "optimizer exp_avg_sq_sum is" in err and "when saved" in err
