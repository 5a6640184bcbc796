"""Checkpoint save/load with resharding: save at TP=2 and resume at TP=1 x DP=2, and the reverse,
with the distributed optimizer and with the plain one (use_distributed_optimizer=False; also at the
same layout, where the resumed step must be bit for bit the uninterrupted one). The resumed run's
next step must equal the uninterrupted run's (weights, Adam step and moments)."""

from __future__ import annotations

import os
from typing import Any

import psutil
import pytest
import torch

from _launch import run_distributed
from engine_helpers import (
    _gather_hf, adam_weight_atol, gather_hf_state, make_batch, make_hf_model, pg_loss_fn, relative_error, save_hf_model,
    scratch_dir,
)

pytestmark = pytest.mark.distributed

CFG = dict(lr=1e-2, eps=1e-2, weight_decay=0.0, clip_grad=1.0, micro_batch_size=2,
           lr_schedule="cosine", lr_warmup_steps=1, total_training_steps=4, min_lr=1e-3)


def _engine(rank: int, world: int, port: int, hf_dir: str, layout_kw: dict, dtype: str,
            distributed: bool = True) -> Any:
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec

    layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**layout_kw))
    engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout,
                            EngineConfig(**{**CFG, "dtype": dtype, "use_distributed_optimizer": distributed}))
    engine.load_hf_weights(hf_dir)
    return engine


def _step(engine: Any, batch: dict) -> dict:
    r = engine.ranks
    shard = {k: v.chunk(r.dp_size)[r.dp_rank] for k, v in batch.items()}
    return engine.train_step(shard, pg_loss_fn, mini_batch_size=len(shard["responses"]), calculate_entropy=True)


def _plain_adam_state(engine: Any) -> dict[str, torch.Tensor] | None:
    """A plain optimizer's fp32 main parameters and Adam moments by HF name ("<state>:<name>"), in
    float64, gathered from every rank; None for the distributed optimizer (its state is sharded
    flat over the DP ranks)."""
    from megarl.megatron.model import unwrap

    if engine.cfg.use_distributed_optimizer:
        return None
    states = {id(p): state for part in engine.optimizer.chained_optimizers for p, state in part.optimizer.state.items()}
    out: dict[str, torch.Tensor] = {}
    for name in ("param", "exp_avg", "exp_avg_sq"):
        local = {}
        for n, p in unwrap(engine.ddp).named_parameters():
            main = getattr(p, "main_param", p)  # bf16: the optimizer's fp32 copy; fp32: the parameter itself
            local[n] = (main if name == "param" else states[id(main)][name]).detach().double().cpu().clone()
        out.update({f"{name}:{k}": v for k, v in _gather_hf(local, engine).items()})
    return out


def _save_then_resume(rank: int, world: int, port: int, hf_dir: str, batches: list, ckpt_dir: str,
                      save_layout: dict, load_layout: dict, dtype: str, distributed: bool) -> dict:
    from megarl.megatron.checkpoint import adam_step

    engine = _engine(rank, world, port, hf_dir, save_layout, dtype, distributed)
    _step(engine, batches[0])
    _step(engine, batches[1])
    engine.save_checkpoint(ckpt_dir)
    children = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)
                if p.status() != psutil.STATUS_ZOMBIE]
    saved, saved_adam = gather_hf_state(engine), _plain_adam_state(engine)
    uninterrupted = _step(engine, batches[2])
    want, want_adam = gather_hf_state(engine), _plain_adam_state(engine)
    want_step = adam_step(engine.optimizer)

    resumed = _engine(rank, world, port, hf_dir, load_layout, dtype, distributed)  # fresh engine, HF weights
    resumed.load_checkpoint(ckpt_dir)
    loaded, loaded_adam = gather_hf_state(resumed), _plain_adam_state(resumed)
    after = _step(resumed, batches[2])
    got, got_adam = gather_hf_state(resumed), _plain_adam_state(resumed)
    return {"saved": saved, "loaded": loaded, "want": want, "got": got, "want_step": want_step,
            "got_step": adam_step(resumed.optimizer), "metrics": (uninterrupted, after),
            "adam": {"saved": saved_adam, "loaded": loaded_adam, "want": want_adam, "got": got_adam},
            "files": sorted(os.listdir(ckpt_dir)), "children_after_save": children}


@pytest.mark.parametrize("save_layout,load_layout,dtype,distributed", [
    (dict(tp=2), dict(), "fp32", True),
    (dict(), dict(tp=2), "bf16", True),
    (dict(tp=2), dict(), "fp32", False),
    (dict(), dict(tp=2), "bf16", False),
    (dict(), dict(), "fp32", False),
    (dict(tp=2), dict(tp=2), "bf16", False),
], ids=["tp2_to_tp1dp2_fp32", "tp1dp2_to_tp2_bf16", "plain_tp2_to_tp1dp2_fp32", "plain_tp1dp2_to_tp2_bf16",
        "plain_tp1dp2_same_layout_fp32", "plain_tp2_same_layout_bf16"])
def test_checkpoint_reshards_and_resumes_exactly(save_layout: dict, load_layout: dict, dtype: str,
                                                 distributed: bool) -> None:
    hf_dir = save_hf_model(make_hf_model("qwen3"))
    batches = [make_batch(seed=10 + i, batch=4) for i in range(3)]
    ckpt_dir = os.path.join(scratch_dir("megarl_ckpt_"), "step_2")
    res = run_distributed(_save_then_resume, 2, hf_dir, batches, ckpt_dir, save_layout, load_layout, dtype,
                          distributed)[0]
    assert "metadata.json" in res["files"] and not os.path.exists(ckpt_dir + ".partial")
    # A save leaves no process behind that could outlive a killed worker (Megatron's writer would
    # otherwise keep a multiprocessing Manager server per rank; see checkpoint.save).
    assert res["children_after_save"] == [], res["children_after_save"]
    for key in res["saved"]:
        assert torch.equal(res["loaded"][key], res["saved"][key]), f"loaded {key} differs from saved"
        err = (res["got"][key] - res["want"][key]).abs().max().item()
        # fp32: the third step's gradient is summed in another order at the other layout, Adam's
        # state before it is the same (lr <= CFG["lr"] on the cosine schedule; clipped to 1): see
        # engine_helpers.adam_weight_atol. bf16: the same fp32 update rounded to bf16; reductions at
        # another TP size may flip a last bit.
        if dtype == "fp32":
            tol = adam_weight_atol(CFG["lr"], CFG["eps"], CFG["clip_grad"], CFG["clip_grad"])
        else:
            tol = 2 ** -7 * res["want"][key].abs().max().item()
        assert err <= tol, f"resumed step: {key} differs by {err}"
        assert not torch.equal(res["want"][key], res["saved"][key]) or key.endswith("norm.weight")
    assert res["got_step"] == res["want_step"] == 3
    uninterrupted, after = res["metrics"]
    assert after["lr"] == pytest.approx(uninterrupted["lr"])
    assert after["loss"] == pytest.approx(uninterrupted["loss"], rel=1e-5 if dtype == "fp32" else 1e-3)
    adam = res["adam"]
    if distributed:  # its moments are checked by the load itself (checkpoint.check_restored)
        return
    # The plain optimizer's fp32 main parameters and moments are loaded as saved, element for element.
    assert adam["saved"] is not None and set(adam["loaded"]) == set(adam["saved"])
    for key in adam["saved"]:
        assert torch.equal(adam["loaded"][key], adam["saved"][key]), f"loaded Adam state {key} differs from saved"
    assert any(adam["saved"][k].abs().sum() > 0 for k in adam["saved"] if k.startswith("exp_avg_sq:"))
    if save_layout == load_layout:
        # Same layout: the resumed step is the uninterrupted one, bit for bit.
        for key in adam["want"]:
            assert torch.equal(adam["got"][key], adam["want"][key]), f"resumed step: Adam state {key} differs"
        for key in res["want"]:
            assert torch.equal(res["got"][key], res["want"][key]), f"resumed step: {key} differs"
        assert {k: after[k] for k in ("loss", "lr", "grad_norm")} == \
            {k: uninterrupted[k] for k in ("loss", "lr", "grad_norm")}
    else:  # another layout: the third step's gradient is summed in another order
        for state in ("param", "exp_avg", "exp_avg_sq"):
            got = {k: v for k, v in adam["got"].items() if k.startswith(state + ":")}
            want = {k: v for k, v in adam["want"].items() if k.startswith(state + ":")}
            err = relative_error(got, want)
            assert err <= (1e-5 if dtype == "fp32" else 1e-2), f"resumed step: Adam {state} differs by {err}"


def _load_with_other_optimizers(rank: int, world: int, port: int, hf_dir: str, batch: dict, ckpt_dir: str) -> list:
    from megarl.errors import CheckpointError

    engine = _engine(rank, world, port, hf_dir, {}, "fp32", distributed=False)
    _step(engine, batch)
    engine.save_checkpoint(ckpt_dir)
    errors = []
    for dtype, distributed in (("fp32", True), ("bf16", False)):
        other = _engine(rank, world, port, hf_dir, {}, dtype, distributed)
        try:
            other.load_checkpoint(ckpt_dir)
        except CheckpointError as err:
            errors.append(str(err))
        else:
            errors.append(None)
    return errors


def test_checkpoint_of_the_plain_optimizer_is_refused_by_another_kind() -> None:
    hf_dir = save_hf_model(make_hf_model("qwen3"))
    ckpt_dir = os.path.join(scratch_dir("megarl_ckpt_"), "step_1")
    to_distributed, to_bf16 = run_distributed(_load_with_other_optimizers, 1, hf_dir, make_batch(seed=1, batch=4),
                                              ckpt_dir)[0]
    saved = "saved with the plain fp32 optimizer (use_distributed_optimizer=false, fp32)"
    assert to_distributed is not None and ckpt_dir in to_distributed and saved in to_distributed
    assert "this policy engine uses the distributed optimizer (use_distributed_optimizer=true)" in to_distributed
    assert to_bf16 is not None and saved in to_bf16 and "uses the plain bf16 optimizer" in to_bf16
