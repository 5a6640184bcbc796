"""Prompt sharing (`model.prompt_sharing`) on CUDA: the masked shared-prompt sequence runs through
torch's fused attention kernels on the GPU (the CPU suite checks the CPU kernels only).

fp32 with TF32 off: log-probs and entropy equal HF's float64 row by row, shared or not, and the
update's gradient equals the float64 reference within the CPU suite's bound; bf16 stays within
the bound test_engine_gpu.py uses. The local layer spec is asked
for explicitly (TransformerEngine's attention takes no mask), so the test runs with or without it.
Skipped without CUDA.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from _launch import run_distributed  # noqa: E402
from engine_helpers import (  # noqa: E402
    GRAD_RTOL, gather_hf_grads, hf_logprobs, make_hf_model, pg_loss_fn, reference_gradients, relative_error,
    save_hf_model,
)
from test_engine_shared_prompts import grouped_batch  # noqa: E402

pytestmark = pytest.mark.gpu


def _passes(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    import torch.distributed as dist

    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    assert dist.get_backend() == "nccl"
    out: dict[str, Any] = {}
    for dtype in ("fp32", "bf16"):
        for mode in ("always", "never"):
            engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), ParallelLayout(), EngineConfig(
                micro_batch_size=4, log_prob_micro_batch_size=4, prompt_sharing=mode, clip_grad=1e9, dtype=dtype),
                use_te=False)
            engine.load_hf_weights(hf_dir)
            shapes: list[tuple[int, int]] = []
            engine.model.embedding.register_forward_pre_hook(
                lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
            res = engine.compute_log_prob(batch, temperature=1.3, calculate_entropy=True)
            res["input_shapes"] = list(shapes)  # the log-prob pass only
            if dtype == "fp32":
                engine.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]),
                                  calculate_entropy=True)
                res["grads"] = gather_hf_grads(engine)
            out[dtype, mode] = res
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_prompt_rows_equal_hf_on_gpu() -> None:
    model = make_hf_model("qwen2", seed=7)
    hf_dir = save_hf_model(model)
    batch = grouped_batch(seed=5)
    mask = batch["response_mask"].bool()
    got = run_distributed(_passes, 1, hf_dir, batch, timeout=300)[0]
    ref_lp, ref_ent = hf_logprobs(model, batch, temperature=1.3)
    # The model saw one sequence per prompt in each micro-batch when sharing, one per row otherwise.
    assert [s[0] for s in got["fp32", "always"]["input_shapes"]] == [2, 3, 1]
    assert [s[0] for s in got["fp32", "never"]["input_shapes"]] == [4, 4, 1]
    for mode in ("always", "never"):
        lp_err = (got["fp32", mode]["log_probs"].double() - ref_lp)[mask].abs().max().item()
        ent_err = (got["fp32", mode]["entropys"].double() - ref_ent)[mask].abs().max().item()
        assert lp_err < 1e-4 and ent_err < 1e-4, f"fp32 {mode}: errors {lp_err}, {ent_err}"
    exact = reference_gradients(model, batch)
    for mode in ("always", "never"):
        assert relative_error(got["fp32", mode]["grads"], exact) < GRAD_RTOL, mode
    # bf16 (the kernels the GPU path runs in practice): the test_engine_gpu bound on both layouts.
    for mode in ("always", "never"):
        err = (got["bf16", mode]["log_probs"].double() - ref_lp)[mask].abs().max().item()
        assert err < 0.5, f"bf16 {mode}: error {err}"
