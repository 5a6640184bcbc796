"""The engine on CUDA: NCCL, TransformerEngine spec when installed, fp32 and bf16.

Same checks as the CPU suite (HF parity, one step against a float64 reference, offload releasing
device memory, checkpoint resume); TP=2 when two GPUs are present. Skipped without CUDA.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from _launch import run_distributed  # noqa: E402
from engine_helpers import (  # noqa: E402
    gather_hf_state,
    hf_logprobs,
    make_batch,
    make_hf_model,
    pg_loss_fn,
    reference_train_step,
    save_hf_model,
)

pytestmark = pytest.mark.gpu

CFG = dict(lr=1e-2, eps=1e-2, weight_decay=0.0, clip_grad=1.0, micro_batch_size=2)


def _world() -> int:
    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def _engine(rank: int, world: int, port: int, hf_dir: str, layout_kw: dict, cfg: dict) -> Any:
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec

    torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 comparisons
    torch.backends.cudnn.allow_tf32 = False
    layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**layout_kw))
    engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout, EngineConfig(**cfg))
    engine.load_hf_weights(hf_dir)
    return engine


def _gpu_checks(rank: int, world: int, port: int, hf_dir: str, batch: dict, ckpt: str) -> dict:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    layout = dict(tp=world)
    fp32 = _engine(rank, world, port, hf_dir, layout, CFG)
    assert dist.get_backend() == "nccl"
    out["lp"] = fp32.compute_log_prob(batch, calculate_entropy=True)
    out["metrics"] = fp32.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]),
                                     calculate_entropy=True)
    out["state"] = gather_hf_state(fp32)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    fp32.offload_to_cpu()
    out["freed_bytes"] = before - torch.cuda.memory_allocated()
    out["offloaded_bytes"] = fp32.offloaded.num_bytes
    fp32.onload()
    out["state_after_onload"] = gather_hf_state(fp32)
    fp32.save_checkpoint(ckpt)
    step2 = fp32.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)
    # Each _engine call re-initialises Megatron's process groups and destroys the previous ones, so an
    # engine is used only until the next one is built (the distributed optimizer's checkpoint looks its
    # data-parallel group up by handle).
    bf16 = _engine(rank, world, port, hf_dir, layout, {**CFG, "dtype": "bf16"})
    out["lp_bf16"] = bf16.compute_log_prob(batch)["log_probs"]
    resumed = _engine(rank, world, port, hf_dir, layout, CFG)
    resumed.load_checkpoint(ckpt)
    step2_resumed = resumed.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]),
                                       calculate_entropy=True)
    out["resume"] = (step2, step2_resumed, gather_hf_state(fp32), gather_hf_state(resumed))
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_on_gpu_matches_hf_and_reference_step() -> None:
    model = make_hf_model("qwen2")
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=2, batch=6)
    ckpt = os.path.join(tempfile.mkdtemp(prefix="megarl_gpu_ckpt_"), "ckpt")
    res = run_distributed(_gpu_checks, _world(), hf_dir, batch, ckpt, timeout=540)[0]
    mask = batch["response_mask"].bool()
    ref_lp, ref_ent = hf_logprobs(model, batch)
    assert (res["lp"]["log_probs"].double() - ref_lp)[mask].abs().max() < 1e-4
    assert (res["lp"]["entropys"].double() - ref_ent)[mask].abs().max() < 1e-4
    assert (res["lp_bf16"].double() - ref_lp)[mask].abs().max() < 0.5
    want, want_norm = reference_train_step(model, batch, lr=CFG["lr"], eps=CFG["eps"], clip_grad=CFG["clip_grad"])
    for key, value in res["state"].items():
        assert (value - want[key]).abs().max() < 1e-4, key
    assert res["metrics"]["grad_norm"][0] == pytest.approx(want_norm, rel=1e-3)
    assert res["offloaded_bytes"] > 0 and res["freed_bytes"] >= 0.9 * res["offloaded_bytes"]
    for key, value in res["state"].items():
        assert torch.equal(value, res["state_after_onload"][key]), key
    step2, step2_resumed, final, final_resumed = res["resume"]
    assert step2["loss"] == pytest.approx(step2_resumed["loss"], rel=1e-5)
    for key, value in final.items():
        assert (value - final_resumed[key]).abs().max() < 1e-6, key
