"""Every model family on CUDA, and seeded sampling of the HF rollout engine on CUDA.

- Log-probs and entropy of each family the CPU suite checks (Llama with GQA, tied and untied, with
  Llama 3.x RoPE scaling; Qwen2's QKV bias; Qwen3's QK-norm; Mistral), padded and packed, equal
  HF's float64 on the CPU row by row (fp32; the bound test_engine_gpu.py uses).
- The HF engine on CUDA samples each response row from its own stream: a seeded call reproduces,
  two rows of one prompt differ, and the batch's halves sampled apart (each knowing its place in
  the batch) give the whole batch's rows.
Skipped without CUDA.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "rollout"))

from _launch import run_distributed  # noqa: E402
from engine_helpers import make_batch, make_hf_model, save_hf_model  # noqa: E402
from rollout_helpers import PAD, prompt_batch, tiny_model  # noqa: E402
from test_engine_hf_parity import KINDS, _log_probs_per_family, check_every_family  # noqa: E402

from megarl.rollout.base import EngineOptions, SamplingParams  # noqa: E402
from megarl.rollout.hf_engine import HFRolloutEngine  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_every_family_padded_and_packed_equals_hf_on_gpu() -> None:
    """The CPU suite's family check (tests/distributed/test_engine_hf_parity.py) with the ranks on
    CUDA (the launcher spawns them there), at the bound test_engine_gpu.py uses."""
    models = {kind: make_hf_model(kind, seed=i) for i, kind in enumerate(KINDS)}
    dirs = {kind: save_hf_model(m) for kind, m in models.items()}
    batch = make_batch(seed=3, batch=5)
    got = run_distributed(_log_probs_per_family, 1, dirs, batch, timeout=300)[0]
    check_every_family(got, models, batch, tolerance=1e-4)


BATCH = [[5, 17, 42, 8], [33, 2], [5, 17, 42, 8], [71, 70, 69, 68, 67, 3]]


def _rows(out) -> list[tuple[int, ...]]:
    return [tuple(r) for r in out["responses"].tolist()]


def test_seeded_sampling_on_gpu_gives_each_row_its_own_reproducible_stream() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(seed=2)

    def engine(seed: int = 0) -> HFRolloutEngine:
        return HFRolloutEngine(copy.deepcopy(model).cuda(), EngineOptions(pad_token_id=PAD, eos_token_ids=(), seed=seed))

    params = SamplingParams(n=3, max_new_tokens=8, temperature=1.5, seed=77)
    whole = engine().generate(prompt_batch(BATCH), params)
    again = engine(seed=9).generate(prompt_batch(BATCH), params)  # the engine's own seed plays no part
    assert _rows(again) == _rows(whole)
    assert torch.equal(again["rollout_log_probs"].cpu(), whole["rollout_log_probs"].cpu())
    # prompts 0 and 2 are the same prompt: their six samples all differ
    assert len(set(_rows(whole)[0:3] + _rows(whole)[6:9])) == 6
    halves = [engine().generate(prompt_batch(BATCH[2 * d:2 * d + 2]),
                                SamplingParams(**{**params.__dict__, "row_offset": 2 * d})) for d in range(2)]
    # fp32: a row decoded in a batch of another shape may round its probabilities differently
    # (~1e-7), which changes a sampled token only if its uniform lies that close to a boundary
    assert _rows(halves[0]) + _rows(halves[1]) == _rows(whole)
    # the sampled log-probs are those of the tokens under the model (processed: temperature 1.5)
    lp = whole["rollout_log_probs"].cpu()
    assert torch.isfinite(lp).all() and (lp <= 0).all()
