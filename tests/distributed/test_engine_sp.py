"""Megatron sequence parallelism (SP) at TP=2 on gloo: with SP each TP rank holds half of the
sequence outside the TP regions (norms, residuals, the value head), so micro-batches are padded to
an even length; log-probs, entropy and values, and one optimizer step, must equal SP off (dense
Qwen2-style model, padded and packed micro-batches, with activation recompute), the TP=1 step
(Qwen3-MoE: Megatron trains MoE at TP > 1 only with SP) and the float64 references; at TP=2 x CP=2
the padding to a multiple of 2*cp*tp must not change results either, nor at TP=2 x PP=2.

Tolerances. Forward outputs: SP moves the same per-position arithmetic to other ranks; what changes
is the row count of the matmuls (the split and the padding), which may change a kernel's blocking,
and an all-reduce becomes a reduce-scatter plus an all-gather, which add the same two partial sums.
SP on and off are two float32 evaluations of one number, so the float32 budget of the HF parity
tests holds (FORWARD_ATOL: 2e-5 on log-probs and entropy of magnitude ~5, about 4e-6 relative).
Gradients: GRAD_RTOL (relative L2 over the model), weights after Adam: adam_weight_atol; both
derived in engine_helpers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _launch import run_distributed
from engine_helpers import (
    GRAD_RTOL,
    adam_weight_atol,
    gather_hf_grads,
    gather_hf_state,
    hf_logprobs,
    make_batch,
    make_hf_model,
    make_moe_model,
    pg_loss_fn,
    reference_gradients,
    reference_train_step,
    relative_error,
    save_hf_model,
    with_state,
)

pytestmark = pytest.mark.distributed

FORWARD_ATOL = 2e-5
# No clipping in the gradient comparisons: Megatron scales its gradient buffers in place when it clips.
TRAIN_CFG = dict(lr=1e-2, eps=1e-2, weight_decay=0.0, clip_grad=1e9, micro_batch_size=3)


def _engine(hf_dir: str, layout: Any, cfg: dict, hf_sd: dict | None = None) -> Any:
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.models.spec import ModelSpec

    engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout, EngineConfig(**cfg))
    if hf_sd is None:
        engine.load_hf_weights(hf_dir)
    else:
        engine.load_hf_state_dict(hf_sd)
    return engine


def _with_head(hf_dir: str, head: torch.Tensor) -> dict[str, torch.Tensor]:
    """The HF checkpoint's tensors with a value head in place of the LM head."""
    from safetensors.torch import load_file

    sd = load_file(f"{hf_dir}/model.safetensors")
    sd.pop("lm_head.weight", None)
    return {**sd, "score.weight": head}


def _value_loss(outputs: dict, mb: dict, n: Any) -> tuple[torch.Tensor, dict]:
    err = (outputs["values"] - mb["returns"]) ** 2 * mb["response_mask"]
    return 0.5 * err.sum() / n.global_num_tokens * n.dp_size, {}


def _dense_tp2(rank: int, world: int, port: int, hf_dir: str, head: torch.Tensor, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(tp=2))
    hf_sd = _with_head(hf_dir, head)
    out: dict[Any, Any] = {}
    for sp in (False, True):
        for packed in (False, True):
            cfg = dict(TRAIN_CFG, sequence_parallel=sp, use_sequence_packing=packed)
            policy = _engine(hf_dir, layout, cfg)
            plan = [(int(m["rows"].tokens.shape[1]), int(m["tokens"].shape[1]))
                    for m in policy._micro_batches(batch, forward_only=True)]
            forward = policy.compute_log_prob(batch, temperature=0.8, calculate_entropy=True)
            metrics = policy.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]),
                                        calculate_entropy=True)
            critic = _engine(hf_dir, layout, dict(cfg, role="value"), hf_sd)
            values = critic.compute_values(batch)
            critic.train_step(batch, _value_loss, mini_batch_size=len(batch["responses"]))
            out[(sp, packed)] = {"plan": plan, "forward": forward, "values": values, "metrics": metrics,
                                 "grads": gather_hf_grads(policy), "critic_grads": gather_hf_grads(critic)}
    # Sequence parallelism with full activation recompute (the recomputed layers redo the
    # sequence-parallel gathers and reduce-scatters in the backward pass).
    policy = _engine(hf_dir, layout, dict(TRAIN_CFG, sequence_parallel=True, recompute_granularity="full"))
    policy.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)
    out["sp_full_recompute"] = gather_hf_grads(policy)
    return out


def test_sequence_parallel_equals_sp_off_dense() -> None:
    model = make_hf_model("qwen2")  # q/k/v biases, GQA
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=25, batch=6, prompt_len=7, response_len=6)  # odd widths 9 and 11
    batch["returns"] = torch.randn(6, 6, generator=torch.Generator().manual_seed(2))
    head = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)) * 0.1
    ref_lp, ref_ent = hf_logprobs(model, batch, temperature=0.8)
    exact = reference_gradients(model, batch)
    mask = batch["response_mask"].bool()
    results = run_distributed(_dense_tp2, 2, hf_dir, head, batch)
    for rank_result in results:
        for packed in (False, True):
            on, off = rank_result[(True, packed)], rank_result[(False, packed)]
            # Padding to an even length happened (padded: per micro-batch; packed: the packed row).
            assert all(width % 2 for width, _ in on["plan"]) or packed, on["plan"]
            assert all(local % 2 == 0 for _, local in on["plan"]), on["plan"]
            assert packed or any(local % 2 for _, local in off["plan"]), off["plan"]
            for key, ref in (("log_probs", ref_lp), ("entropys", ref_ent)):
                got = on["forward"][key]
                assert (got - off["forward"][key])[mask].abs().max() < FORWARD_ATOL, (packed, key)
                assert (got.double() - ref)[mask].abs().max() < FORWARD_ATOL, (packed, key)
                assert torch.all(got[~mask] == 0), (packed, key)
            scale = off["values"].abs().max()
            assert scale > 0 and (on["values"] - off["values"])[mask].abs().max() < FORWARD_ATOL * scale, packed
            assert on["metrics"]["loss"][0] == pytest.approx(off["metrics"]["loss"][0], rel=GRAD_RTOL)
            assert on["metrics"]["grad_norm"][0] == pytest.approx(off["metrics"]["grad_norm"][0], rel=GRAD_RTOL)
            for name in ("grads", "critic_grads"):
                err = relative_error(on[name], off[name])
                assert err < GRAD_RTOL, f"packed={packed} {name}: SP on vs off differ by {err:.2e} (relative L2)"
            assert relative_error(on["grads"], exact) < GRAD_RTOL, packed
            # The value head and the norms are the parameters whose gradients SP sums over TP.
            assert on["critic_grads"]["score.weight"].abs().max() > 0
        err = relative_error(rank_result["sp_full_recompute"], rank_result[(False, False)]["grads"])
        assert err < GRAD_RTOL, f"SP with full recompute: gradient differs by {err:.2e}"


def _moe(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    out: dict[str, Any] = {}
    cfg = dict(TRAIN_CFG, clip_grad=1.0, micro_batch_size=2)
    layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(tp=2))
    for packed in (False, True):
        forward_only = _engine(hf_dir, layout, dict(cfg, use_sequence_packing=packed))  # SP off: forward works
        out[("forward", packed)] = forward_only.compute_log_prob(batch, calculate_entropy=True)
        engine = _engine(hf_dir, layout, dict(cfg, sequence_parallel=True, use_sequence_packing=packed))
        out[("sp_forward", packed)] = engine.compute_log_prob(batch, calculate_entropy=True)
        metrics = engine.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)
        out[("sp", packed)] = (gather_hf_grads(engine), gather_hf_state(engine), metrics["grad_norm"][0])
    # TP=1, DP=2: each rank takes half of the rows; plain optimizer so that every rank has the
    # whole reduced gradient.
    layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    engine = _engine(hf_dir, layout, dict(cfg, use_distributed_optimizer=False))
    r = engine.ranks
    shard = {k: v.chunk(r.dp_size)[r.dp_rank] for k, v in batch.items()}
    metrics = engine.train_step(shard, pg_loss_fn, mini_batch_size=len(shard["responses"]), calculate_entropy=True)
    out["tp1"] = (gather_hf_grads(engine), gather_hf_state(engine), metrics["grad_norm"][0])
    return out


def test_moe_trains_at_tp2_with_sequence_parallelism() -> None:
    """Megatron refuses MoE training at TP > 1 without SP; with it, one step at TP=2 equals the
    TP=1 step (gradients) and the float64 AdamW step (weights)."""
    from safetensors.torch import load_file

    model = make_moe_model("qwen3_moe", seed=5)
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=22, batch=6)
    lr, eps, clip = TRAIN_CFG["lr"], TRAIN_CFG["eps"], 1.0
    want, want_norm = reference_train_step(model, batch, lr, eps, clip)
    # HF keeps the experts fused in memory; the checkpoint names (the engine's) have them one by one.
    want = load_file(f"{save_hf_model(with_state(model, want))}/model.safetensors")
    # Megatron clips its gradient buffers in place, by clip / (norm + 1e-6) as the reference does.
    scale = min(1.0, clip / (want_norm + 1e-6))
    exact = {k: g * scale for k, g in reference_gradients(model, batch).items()}
    exact = load_file(f"{save_hf_model(with_state(model, exact))}/model.safetensors")
    start = load_file(f"{hf_dir}/model.safetensors")
    ref_lp, ref_ent = hf_logprobs(model, batch)
    mask = batch["response_mask"].bool()
    results = run_distributed(_moe, 2, hf_dir, batch)
    tp1_grads, _, tp1_norm = results[0]["tp1"]
    assert relative_error(tp1_grads, exact) < GRAD_RTOL
    atol = adam_weight_atol(lr, eps, want_norm, clip)
    for rank_result in results:
        for packed in (False, True):
            for key, ref in (("log_probs", ref_lp), ("entropys", ref_ent)):
                got = rank_result[("sp_forward", packed)][key]
                assert (got - rank_result[("forward", packed)][key])[mask].abs().max() < FORWARD_ATOL, (packed, key)
                assert (got.double() - ref)[mask].abs().max() < FORWARD_ATOL, (packed, key)
            grads, state, grad_norm = rank_result[("sp", packed)]
            assert grad_norm == pytest.approx(tp1_norm, rel=GRAD_RTOL)
            assert grad_norm == pytest.approx(want_norm, rel=GRAD_RTOL)
            err = relative_error(grads, tp1_grads)
            assert err < GRAD_RTOL, f"packed={packed}: TP=2+SP gradient differs from TP=1 by {err:.2e}"
            assert set(state) == set(want)
            moved = 0
            for name, w in want.items():
                diff = (state[name] - w).abs().max().item()
                assert diff < atol, f"packed={packed} {name}: {diff}"
                moved += int((w - start[name]).abs().max() > 1e-4)
            assert moved > len(want) // 2, "the step should change most tensors"


def _four_ranks(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    out: dict[Any, Any] = {}
    for name, kw in (("cp2", dict(tp=2, cp=2)), ("pp2", dict(tp=2, pp=2))):
        layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**kw))
        for packed in (False, True):
            # The plain optimizer: the distributed one keeps a shard of the gradient per CP rank.
            cfg = dict(TRAIN_CFG, sequence_parallel=True, use_sequence_packing=packed, use_distributed_optimizer=False)
            engine = _engine(hf_dir, layout, cfg)
            out[(name, "plan", packed)] = [(int(m["rows"].tokens.shape[1]), int(m["tokens"].shape[1]))
                                           for m in engine._micro_batches(batch, forward_only=True)]
            out[(name, packed)] = engine.compute_log_prob(batch, calculate_entropy=True)
            engine.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)
            out[(name, "grads", packed)] = gather_hf_grads(engine)
    return out


def test_sequence_parallel_with_context_and_pipeline_parallel() -> None:
    """Four processes. TP=2 x CP=2: each micro-batch is padded to a multiple of 2*cp*tp = 8, split
    over the CP ranks and each CP share over the TP ranks. TP=2 x PP=2: the stages exchange
    sequence-parallel activations (s/tp positions)."""
    model = make_hf_model("llama")
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=23, batch=6, prompt_len=7, response_len=6)
    ref_lp, ref_ent = hf_logprobs(model, batch)
    exact = reference_gradients(model, batch)
    mask = batch["response_mask"].bool()
    for rank_result in run_distributed(_four_ranks, 4, hf_dir, batch):
        plan = rank_result[("cp2", "plan", False)]
        assert any(width % 8 for width, _ in plan) and all(local % 4 == 0 for _, local in plan), plan
        assert any(width % 2 for width, _ in rank_result[("pp2", "plan", False)])
        for name in ("cp2", "pp2"):
            for packed in (False, True):
                for key, ref in (("log_probs", ref_lp), ("entropys", ref_ent)):
                    got = rank_result[(name, packed)][key].double()
                    assert (got - ref)[mask].abs().max() < FORWARD_ATOL, (name, packed, key)
                err = relative_error(rank_result[(name, "grads", packed)], exact)
                assert err < GRAD_RTOL, f"{name} tp=2 sp packed={packed}: gradient differs from float64 by {err:.2e}"
