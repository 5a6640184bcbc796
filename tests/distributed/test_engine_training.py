"""Train-step semantics on one process: gradient independent of the micro-batch split (fixed and
dynamic by token budget) and of activation recompute, log-probs independent of the forward
micro-batch size, LR schedules, and an exact offload/onload round trip."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from _launch import run_distributed
from engine_helpers import (
    GRAD_RTOL,
    gather_hf_grads,
    gather_hf_state,
    hf_logprobs,
    make_batch,
    make_hf_model,
    pg_loss_fn,
    reference_gradients,
    relative_error,
    save_hf_model,
)

pytestmark = pytest.mark.distributed

# No clipping: the gradient is read from Megatron's buffers after the step, which clipping scales.
BASE = dict(lr=1e-3, eps=1e-6, weight_decay=0.0, clip_grad=1e9)


def _engine(hf_dir: str, **cfg: Any) -> Any:
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.layout import ParallelLayout
    from megarl.models.spec import ModelSpec

    engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), ParallelLayout(), EngineConfig(**{**BASE, **cfg}))
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
        out[name] = (gather_hf_grads(engine), metrics, [len(m["index"]) for m in micro])
    return out


def test_gradient_does_not_depend_on_micro_batch_split() -> None:
    """The gradients themselves are compared (not the weights after AdamW, whose update
    g / (sqrt(g^2) + eps) turns a rounding difference in a near-zero gradient into a weight
    difference up to lr), as a relative L2 error over the whole model: see GRAD_RTOL."""
    model = make_hf_model("llama")
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=5, batch=8)
    exact = reference_gradients(model, batch)  # float64
    res = run_distributed(_splits, 1, hf_dir, batch)[0]
    assert res["mbs1"][2] == [1] * 8 and res["mbs8"][2] == [8]
    assert len(res["dynamic"][2]) > 1 and sum(res["dynamic"][2]) == 8, res["dynamic"][2]
    assert len(res["packed"][2]) < len(res["dynamic"][2])  # packing fits more rows in the budget
    want_grads, want_metrics, _ = res["mbs8"]
    assert relative_error(want_grads, exact) < GRAD_RTOL
    for name in ("mbs1", "mbs2", "dynamic", "packed"):
        grads, metrics, _ = res[name]
        # loss and grad norm are a sum and a norm of the compared quantities: same relative budget.
        assert metrics["loss"][0] == pytest.approx(want_metrics["loss"][0], rel=GRAD_RTOL), name
        assert metrics["grad_norm"][0] == pytest.approx(want_metrics["grad_norm"][0], rel=GRAD_RTOL), name
        err = relative_error(grads, want_grads)
        assert err < GRAD_RTOL, f"{name}: gradient differs from one micro-batch's by {err:.2e} (relative L2)"
        assert relative_error(grads, exact) < GRAD_RTOL, name


def _recompute(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.model import unwrap
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    out = {}
    for granularity in (None, "full", "selective"):
        engine = _engine(hf_dir, micro_batch_size=3, recompute_granularity=granularity)
        layer = unwrap(engine.ddp).decoder.layers[0]
        calls = {"layer": 0, "core_attention": 0}
        layer.register_forward_hook(lambda *_: calls.__setitem__("layer", calls["layer"] + 1))
        layer.self_attention.core_attention.register_forward_hook(
            lambda *_: calls.__setitem__("core_attention", calls["core_attention"] + 1))
        metrics = engine.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)
        out[granularity] = (gather_hf_grads(engine), metrics, dict(calls))
    return out


def test_activation_recompute_gives_the_same_loss_and_gradient() -> None:
    hf_dir = save_hf_model(make_hf_model("qwen3"))
    batch = make_batch(seed=9, batch=6)
    res = run_distributed(_recompute, 1, hf_dir, batch)[0]
    want_grads, want_metrics, calls = res[None]
    assert calls == {"layer": 2, "core_attention": 2}  # two micro-batches, forward once each
    # Full: each layer runs again in the backward pass; selective: only the core attention.
    assert res["full"][2] == {"layer": 4, "core_attention": 4}
    assert res["selective"][2] == {"layer": 2, "core_attention": 4}
    for granularity in ("full", "selective"):
        grads, metrics, _ = res[granularity]
        # The recomputed forward repeats the same kernels on the same shapes; the budget for two
        # float32 evaluations of one gradient (GRAD_RTOL) bounds it with a wide margin.
        assert metrics["loss"][0] == pytest.approx(want_metrics["loss"][0], rel=GRAD_RTOL)
        err = relative_error(grads, want_grads)
        assert err < GRAD_RTOL, f"recompute={granularity}: gradient differs by {err:.2e} (relative L2)"


def _forward_sizes(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    out = {}
    for size in (0, 1, 4):  # 0: micro_batch_size (6), one micro-batch
        policy = _engine(hf_dir, micro_batch_size=6, log_prob_micro_batch_size=size)
        critic = _engine(hf_dir, micro_batch_size=6, log_prob_micro_batch_size=size, role="value")
        plan = [len(m["index"]) for m in policy._micro_batches(batch, forward_only=True)]
        train_plan = [len(m["index"]) for m in policy._micro_batches(batch)]
        out[size] = (plan, train_plan, policy.compute_log_prob(batch, calculate_entropy=True),
                     critic.compute_values(batch))
    return out


def test_log_probs_and_values_do_not_depend_on_log_prob_micro_batch_size() -> None:
    model = make_hf_model("qwen2")
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=4, batch=6)
    ref_lp, ref_ent = hf_logprobs(model, batch)
    mask = batch["response_mask"].bool()
    res = run_distributed(_forward_sizes, 1, hf_dir, batch)[0]
    assert [res[s][0] for s in (0, 1, 4)] == [[6], [1] * 6, [4, 2]]
    assert all(res[s][1] == [6] for s in res)  # train_step keeps micro_batch_size
    _, _, want, want_values = res[0]
    for size, (_, _, got, values) in res.items():
        for key, ref in (("log_probs", ref_lp), ("entropys", ref_ent)):
            # 2e-5: the float32 budget of the HF parity tests (log-probs near -5.3 = -log 200).
            assert (got[key].double() - ref)[mask].abs().max() < 2e-5, (size, key)
            assert (got[key] - want[key])[mask].abs().max() < 2e-5, (size, key)
        assert (values - want_values)[mask].abs().max() < 2e-5 * want_values.abs().max(), size
        assert bool((values[mask] != 0).all()), "values must be computed"


def _schedules(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    out = {}
    for style in ("constant", "cosine", "linear"):
        engine = _engine(hf_dir, micro_batch_size=4, lr=1e-3, min_lr=1e-4, lr_schedule=style,
                         lr_warmup_steps=2, total_training_steps=6)
        m = engine.train_step(batch, pg_loss_fn, mini_batch_size=2, epochs=4, shuffle=True,
                              calculate_entropy=True)
        out[style] = m["lr"]
    return out


def test_lr_schedules_warmup_then_constant_cosine_or_linear() -> None:
    """lr of optimizer steps 0..7: warmup over 2 steps from 0, decay over steps 2..6 to min_lr, then
    min_lr (8 steps: 4 epochs of 2 mini-batches)."""
    hf_dir = save_hf_model(make_hf_model("qwen2", num_layers=1))
    batch = make_batch(seed=6, batch=4)
    res = run_distributed(_schedules, 1, hf_dir, batch)[0]
    warmup = [0.0, 0.5e-3]
    assert res["constant"] == pytest.approx(warmup + [1e-3] * 6)
    cosine = [1e-4 + 0.5 * (1 + math.cos(math.pi * (s - 2) / 4)) * (1e-3 - 1e-4) for s in range(2, 7)]
    assert res["cosine"] == pytest.approx(warmup + cosine + [1e-4])
    # Linear: 1e-3 at step 2, down by (1e-3 - 1e-4) / 4 a step, 1e-4 from step 6 on.
    assert res["linear"] == pytest.approx(warmup + [1e-3, 7.75e-4, 5.5e-4, 3.25e-4, 1e-4, 1e-4])


def _snapshot(engine: Any) -> dict[str, torch.Tensor]:
    from megarl.megatron.offload import _optimizer_tensors

    snap = {f"param.{n}": t.clone() for n, t in engine.get_named_weights()}
    for i, buf in enumerate(engine.ddp.buffers):
        snap[f"grad.{i}"] = buf.grad_data.clone()
    for i, t in enumerate(_optimizer_tensors(engine.optimizer)):
        snap[f"opt.{i}"] = t.detach().clone()
    return snap


def _offload(rank: int, world: int, port: int, hf_dir: str, batches: list) -> dict:
    from megarl.errors import EngineStateError
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    plain = _engine(hf_dir, micro_batch_size=2, dtype="bf16")
    moved = _engine(hf_dir, micro_batch_size=2, dtype="bf16")
    for engine in (plain, moved):
        engine.train_step(batches[0], pg_loss_fn, mini_batch_size=4, calculate_entropy=True)
    before = _snapshot(moved)
    moved.offload_to_cpu()
    released = sum(t.untyped_storage().size() for t, _, _ in moved.offloaded.entries)
    offloaded_bytes = moved.offloaded.num_bytes
    moved.onload()
    after = _snapshot(moved)
    same = {k: torch.equal(before[k], after[k]) for k in before}
    lp_plain = plain.compute_log_prob(batches[1])["log_probs"]
    moved.offload_to_cpu()
    refused = []
    for call in (lambda: moved.compute_log_prob(batches[1]),
                 lambda: moved.train_step(batches[1], pg_loss_fn, mini_batch_size=4)):
        try:
            call()
        except EngineStateError as err:
            refused.append(str(err))
    # The parameters alone come back for a forward pass; gradients and optimizer state stay out.
    moved.onload(("params",))
    lp_moved = moved.compute_log_prob(batches[1])["log_probs"]
    still_out = {group: sum(t.untyped_storage().size() for t, _, g in moved.offloaded.entries if g == group)
                 for group in ("grads", "optimizer")}
    groups_out = sorted(moved.offloaded.groups)
    try:
        moved.train_step(batches[1], pg_loss_fn, mini_batch_size=4)
    except EngineStateError as err:
        refused.append(str(err))
    moved.offload_to_cpu()  # the parameters go back out; the rest stays where it is
    moved.onload()
    m_plain = plain.train_step(batches[1], pg_loss_fn, mini_batch_size=4, calculate_entropy=True)
    m_moved = moved.train_step(batches[1], pg_loss_fn, mini_batch_size=4, calculate_entropy=True)
    return {"same": same, "released": released, "bytes": offloaded_bytes, "n": len(before), "refused": refused,
            "still_out": still_out, "groups_out": groups_out,
            "lp": (lp_plain, lp_moved), "metrics": (m_plain, m_moved),
            "final": (gather_hf_state(plain), gather_hf_state(moved))}


def test_offload_onload_round_trip_is_exact_and_training_continues_identically() -> None:
    hf_dir = save_hf_model(make_hf_model("qwen3", num_layers=1))
    batches = [make_batch(seed=7, batch=4), make_batch(seed=8, batch=4)]
    res = run_distributed(_offload, 1, hf_dir, batches)[0]
    assert res["n"] > 10 and all(res["same"].values()), [k for k, v in res["same"].items() if not v]
    assert res["released"] == 0 and res["bytes"] > 0  # every offloaded storage had been freed
    # Computing with an offloaded engine is refused by name, not a crash on freed storage.
    assert len(res["refused"]) == 3, res["refused"]
    assert "compute_log_prob while its params are offloaded to host memory" in res["refused"][0]
    assert "train_step while its grads, optimizer, params are offloaded" in res["refused"][1]
    # Parameters only on the device: log-probs are exact, an optimizer step is refused by name.
    assert res["groups_out"] == ["grads", "optimizer"] and res["still_out"] == {"grads": 0, "optimizer": 0}
    assert "train_step while its grads, optimizer are offloaded" in res["refused"][2]
    assert torch.equal(*res["lp"])
    m_plain, m_moved = res["metrics"]
    assert m_plain == m_moved
    final_plain, final_moved = res["final"]
    for key in final_plain:
        assert torch.equal(final_plain[key], final_moved[key]), key


def _fused_adam(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    out = {}
    for name, distributed, fused in (("distributed", True, True), ("plain", False, True), ("unfused", False, False)):
        engine = _engine(hf_dir, micro_batch_size=4, use_distributed_optimizer=distributed)
        inner = engine.optimizer.optimizer
        out[f"{name}_flags"] = {(g["fused"], g["foreach"]) for g in inner.param_groups}
        if not fused:  # torch's per-parameter AdamW, as Megatron builds it on CPU
            for group in inner.param_groups:
                group["fused"], group["foreach"] = False, None
        engine.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)
        out[name] = gather_hf_state(engine)
    return out


def test_host_adam_is_fused_and_steps_like_torchs_per_parameter_adamw() -> None:
    """On CPU the Megatron optimizer's torch AdamW runs its fused kernel (`fuse_host_adam`), with the
    distributed optimizer or without; one step of it moves the weights as the per-parameter AdamW
    does. Both see the same gradient (same engine, batch and weights), so they differ only by the
    rounding of the update itself: a few float32 ulps of the weight plus a few of lr."""
    model = make_hf_model("llama")
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=3, batch=4)
    res = run_distributed(_fused_adam, 1, hf_dir, batch)[0]
    assert res["distributed_flags"] == {(True, False)} and res["plain_flags"] == {(True, False)}
    ulp = torch.finfo(torch.float32).eps
    initial = model.state_dict()
    moved = 0
    for key, want in res["unfused"].items():
        got = res["plain"][key]
        assert torch.allclose(got, want, rtol=4 * ulp, atol=4 * ulp * BASE["lr"]), key
        assert torch.allclose(res["distributed"][key], want, rtol=4 * ulp, atol=4 * ulp * BASE["lr"]), key
        moved += int(not torch.equal(want, initial[key].to(want.dtype)))
    assert moved > 0  # the step changed weights (the comparison is not of untouched tensors)
