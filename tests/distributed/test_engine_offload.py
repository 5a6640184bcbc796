"""Offloading the optimizer state alone (`actor.optimizer_offload` without `param_offload`) leaves the
model parameters on the device in every precision and optimizer kind.

In fp32 without the distributed optimizer Megatron's optimizer steps the model parameters
themselves (there are no separate fp32 main parameters): those tensors belong to the "params"
group, never to "optimizer", or an optimizer-only offload would free the weights that the next
forward pass (old log-probs, with only the parameters onloaded) reads."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _launch import run_distributed
from engine_helpers import gather_hf_state, make_batch, make_hf_model, pg_loss_fn, save_hf_model

pytestmark = pytest.mark.distributed

BASE = dict(lr=1e-3, eps=1e-6, weight_decay=0.0, clip_grad=1e9, micro_batch_size=2)
CASES = {"fp32_plain_ddp": dict(dtype="fp32", use_distributed_optimizer=False),
         "fp32_distributed": dict(dtype="fp32", use_distributed_optimizer=True),
         "bf16_plain_ddp": dict(dtype="bf16", use_distributed_optimizer=False),
         "bf16_distributed": dict(dtype="bf16", use_distributed_optimizer=True)}


def _engine(hf_dir: str, **cfg: Any) -> Any:
    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.models.spec import ModelSpec

    engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), ParallelLayout(), EngineConfig(**{**BASE, **cfg}))
    engine.load_hf_weights(hf_dir)
    return engine


def _optimizer_only(rank: int, world: int, port: int, hf_dir: str, batches: list) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.model import unwrap
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    out = {}
    for name, cfg in CASES.items():
        plain, moved = _engine(hf_dir, **cfg), _engine(hf_dir, **cfg)
        for engine in (plain, moved):
            engine.train_step(batches[0], pg_loss_fn, mini_batch_size=4, calculate_entropy=True)
        lp_before = moved.compute_log_prob(batches[1])["log_probs"]
        params = list(unwrap(moved.ddp).parameters())
        moved.offload_to_cpu(params=False, grads=False, optimizer=True)
        groups_out = sorted(moved.offloaded.groups) if moved.offloaded is not None else []
        # Adam's moments are in host memory; no parameter lost its storage.
        moments = [t for opt in getattr(moved.optimizer, "chained_optimizers", [moved.optimizer])
                   for per_param in opt.optimizer.state.values() for t in per_param.values()]
        moments_freed = all(t.untyped_storage().size() == 0 for t in moments)
        params_resident = all(p.untyped_storage().size() > 0 for p in params)
        moved.onload(("params",))  # what the trainer does before a forward pass: nothing to bring back
        lp_params_only = moved.compute_log_prob(batches[1])["log_probs"]
        moved.onload()
        m_plain = plain.train_step(batches[1], pg_loss_fn, mini_batch_size=4, calculate_entropy=True)
        m_moved = moved.train_step(batches[1], pg_loss_fn, mini_batch_size=4, calculate_entropy=True)
        out[name] = {"groups_out": groups_out, "moments_freed": moments_freed and len(moments) > 0,
                     "params_resident": params_resident, "lp": (lp_before, lp_params_only),
                     "metrics": (m_plain, m_moved), "final": (gather_hf_state(plain), gather_hf_state(moved))}
    return out


def test_optimizer_only_offload_keeps_the_parameters_and_training_continues_identically() -> None:
    hf_dir = save_hf_model(make_hf_model("qwen3", num_layers=1))
    batches = [make_batch(seed=7, batch=4), make_batch(seed=8, batch=4)]
    res = run_distributed(_optimizer_only, 1, hf_dir, batches)[0]
    for name, case in res.items():
        assert case["groups_out"] == ["optimizer"], (name, case["groups_out"])
        assert case["moments_freed"], name
        assert case["params_resident"], name
        assert torch.equal(*case["lp"]), name
        m_plain, m_moved = case["metrics"]
        assert m_plain == m_moved, name
        final_plain, final_moved = case["final"]
        for key in final_plain:
            assert torch.equal(final_plain[key], final_moved[key]), (name, key)
