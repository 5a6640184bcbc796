"""benchmarks/rollout.py: where the HF engine runs, and its variants (cache, linear layers) computing
what the engine computes. No timing is asserted."""

from __future__ import annotations

import pytest
import torch
from report import _rollout
from rollout import HF_VARIANTS, parse_args, run

from megarl.rollout.hf_engine import PACK_MIN_HIDDEN_SIZE, PackedLinear, packs_linear_weights

pytestmark = pytest.mark.unit

TINY = ["--num-prompts", "2", "--n", "2", "--max-new-tokens", "3", "--repeats", "1", "--dtype", "bfloat16"]


def test_the_cache_variants_sample_what_the_engine_samples_on_the_device_recorded() -> None:
    """A bf16 cache cast at every token and a float32 one hold the same values, so with one seed
    each variant samples the engine's own tokens; the record names the HF engine's device (the
    CPU here, where torch sees no GPU) and the report says it only where a GPU was there."""
    result = run(parse_args(TINY + ["--engines", "hf,hf_cast_cache,hf_float32_cache", "--device", "cpu"]))
    assert result["config"]["hf_device"] == "cpu"
    for name in ("hf_cast_cache", "hf_float32_cache"):
        assert result["engines"][name]["same_responses_as_hf"] is True, name
        assert result["engines"][name]["generated_tokens_per_call"] == 2 * 2 * 3
    assert not _rollout({**result, "machine": {**result["machine"], "cuda": False}}).startswith("HF engine on")
    assert result["engine_cache_over_cast_cache"] > 0 and result["engine_cache_over_float32_cache"] > 0
    assert _rollout({**result, "machine": {**result["machine"], "cuda": True}}).startswith("HF engine on the host CPU: hf ")
    on_gpu = {**result, "config": {**result["config"], "hf_device": "cuda"}}
    assert _rollout(on_gpu).startswith("HF engine on cuda: hf ")
    # results written before --device carry no hf_device: their HF engine ran on the CPU
    older = {**result, "config": {k: v for k, v in result["config"].items() if k != "hf_device"},
             "machine": {**result["machine"], "cuda": True}}
    assert _rollout(older).startswith("HF engine on the host CPU: ")


def test_the_plain_linear_variant_runs_nn_linear_and_gives_the_packing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """`hf_plain_linear` times the engine's linear layers as `nn.Linear`s (`F.linear` on the plain
    weights) and turns them back into `PackedLinear`s after each call."""
    if not packs_linear_weights(torch.device("cpu"), torch.bfloat16, PACK_MIN_HIDDEN_SIZE):
        pytest.skip("no oneDNN bfloat16 kernels on this processor: the engine packs nothing")
    monkeypatch.setattr("megarl.rollout.hf_engine.PACK_MIN_HIDDEN_SIZE", 0)  # the tiny model's layers PackedLinear too
    result = run(parse_args(TINY + ["--engines", "hf,hf_plain_linear", "--device", "cpu", "--update-between-calls"]))
    assert result["engines"]["hf_plain_linear"]["generated_tokens_per_call"] == 2 * 2 * 3
    assert result["packed_linear_over_plain_linear"] > 0

    class Engine:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    Engine.model[0].__class__ = PackedLinear
    undo = HF_VARIANTS["hf_plain_linear"][0](Engine)
    assert [type(m) for m in Engine.model] == [torch.nn.Linear, torch.nn.Linear]
    undo()
    assert [type(m) for m in Engine.model] == [PackedLinear, torch.nn.Linear]
