"""Train-step semantics on one process: gradient independent of the micro-batch split (fixed and
dynamic by token budget), LR schedules, and an exact offload/onload round trip."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from _launch import run_distributed
from engine_helpers import gather_hf_state, make_batch, make_hf_model, pg_loss_fn, save_hf_model

pytestmark = pytest.mark.distributed

# Large clip threshold and a small eps: any error in the gradient scale shows in the weights.
BASE = dict(lr=1e-3, eps=1e-6, weight_decay=0.0, clip_grad=1e9)


def _engine(hf_dir: str, **cfg: Any) -> Any:
    from megarl.megatron.engine import MegatronEngine
    from megarl.layout import ParallelLayout
    from megarl.models.spec import ModelSpec

    engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), ParallelLayout(), {**BASE, **cfg})
    engine.load_hf_weights(hf_dir)
    return engine


def _splits(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    out = {}
    splits = {"mbs1": dict(micro_batch_size=1), "mbs2": dict(micro_batch_size=2),
              "mbs8": dict(micro_batch_size=8),
              "dynamic": dict(use_dynamic_bsz=True, max_token_len_per_micro_batch=24),
              "packed": dict(use_dynamic_bsz=True, max_token_len_per_micro_batch=24, use_sequence_packing=True)}
    for name, cfg in splits.items():
        engine = _engine(hf_dir, **cfg)
        micro = engine._micro_batches(batch)
        metrics = engine.train_step(batch, pg_loss_fn, mini_batch_size=8, calculate_entropy=True)
        out[name] = (gather_hf_state(engine), metrics, [len(m["index"]) for m in micro])
    return out


def test_gradient_does_not_depend_on_micro_batch_split() -> None:
    hf_dir = save_hf_model(make_hf_model("llama"))
    batch = make_batch(seed=5, batch=8)
    res = run_distributed(_splits, 1, hf_dir, batch)[0]
    assert res["mbs1"][2] == [1] * 8 and res["mbs8"][2] == [8]
    assert len(res["dynamic"][2]) > 1 and sum(res["dynamic"][2]) == 8, res["dynamic"][2]
    assert len(res["packed"][2]) < len(res["dynamic"][2])  # packing fits more rows in the budget
    want_state, want_metrics, _ = res["mbs8"]
    for name in ("mbs1", "mbs2", "dynamic", "packed"):
        state, metrics, _ = res[name]
        assert metrics["loss"][0] == pytest.approx(want_metrics["loss"][0], rel=1e-5), name
        assert metrics["grad_norm"][0] == pytest.approx(want_metrics["grad_norm"][0], rel=1e-4), name
        for key, value in state.items():
            err = (value - want_state[key]).abs().max().item()
            assert err < 1e-6, f"{name}: {key} differs by {err}"


def _schedules(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    out = {}
    for style in ("constant", "cosine"):
        engine = _engine(hf_dir, micro_batch_size=4, lr=1e-3, min_lr=1e-4, lr_schedule=style,
                         lr_warmup_steps=2, total_training_steps=6)
        m = engine.train_step(batch, pg_loss_fn, mini_batch_size=2, epochs=3, shuffle=True,
                              calculate_entropy=True)
        out[style] = m["lr"]
    return out


def test_lr_schedules_warmup_then_constant_or_cosine() -> None:
    hf_dir = save_hf_model(make_hf_model("qwen2", num_layers=1))
    batch = make_batch(seed=6, batch=4)
    res = run_distributed(_schedules, 1, hf_dir, batch)[0]
    warmup = [0.0, 0.5e-3]
    assert res["constant"] == pytest.approx(warmup + [1e-3] * 4)
    cosine = [1e-4 + 0.5 * (1 + math.cos(math.pi * (s - 2) / 4)) * (1e-3 - 1e-4) for s in range(2, 6)]
    assert res["cosine"] == pytest.approx(warmup + cosine)


def _snapshot(engine: Any) -> dict[str, torch.Tensor]:
    from megarl.megatron.offload import _optimizer_tensors

    snap = {f"param.{n}": t.clone() for n, t in engine.get_named_weights()}
    for i, buf in enumerate(engine.ddp.buffers):
        snap[f"grad.{i}"] = buf.grad_data.clone()
    for i, t in enumerate(_optimizer_tensors(engine.optimizer)):
        snap[f"opt.{i}"] = t.detach().clone()
    return snap


def _offload(rank: int, world: int, port: int, hf_dir: str, batches: list) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    plain = _engine(hf_dir, micro_batch_size=2, dtype="bf16")
    moved = _engine(hf_dir, micro_batch_size=2, dtype="bf16")
    for engine in (plain, moved):
        engine.train_step(batches[0], pg_loss_fn, mini_batch_size=4, calculate_entropy=True)
    before = _snapshot(moved)
    moved.offload_to_cpu()
    released = sum(t.untyped_storage().size() for t, _ in moved.offloaded.entries)
    offloaded_bytes = moved.offloaded.num_bytes
    moved.onload()
    after = _snapshot(moved)
    same = {k: torch.equal(before[k], after[k]) for k in before}
    lp_plain = plain.compute_log_prob(batches[1])["log_probs"]
    moved.offload_to_cpu()
    moved.onload()
    lp_moved = moved.compute_log_prob(batches[1])["log_probs"]
    m_plain = plain.train_step(batches[1], pg_loss_fn, mini_batch_size=4, calculate_entropy=True)
    m_moved = moved.train_step(batches[1], pg_loss_fn, mini_batch_size=4, calculate_entropy=True)
    return {"same": same, "released": released, "bytes": offloaded_bytes, "n": len(before),
            "lp": (lp_plain, lp_moved), "metrics": (m_plain, m_moved),
            "final": (gather_hf_state(plain), gather_hf_state(moved))}


def test_offload_onload_round_trip_is_exact_and_training_continues_identically() -> None:
    hf_dir = save_hf_model(make_hf_model("qwen3", num_layers=1))
    batches = [make_batch(seed=7, batch=4), make_batch(seed=8, batch=4)]
    res = run_distributed(_offload, 1, hf_dir, batches)[0]
    assert res["n"] > 10 and all(res["same"].values()), [k for k, v in res["same"].items() if not v]
    assert res["released"] == 0 and res["bytes"] > 0  # every offloaded storage had been freed
    assert torch.equal(*res["lp"])
    m_plain, m_moved = res["metrics"]
    assert m_plain == m_moved
    final_plain, final_moved = res["final"]
    for key in final_plain:
        assert torch.equal(final_plain[key], final_moved[key]), key
