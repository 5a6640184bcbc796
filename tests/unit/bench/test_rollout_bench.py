"""benchmarks/rollout.py: where the HF engine runs, and its cache variants computing what the engine
computes. No timing is asserted."""

from __future__ import annotations

import pytest
from report import _rollout
from rollout import parse_args, run

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
    assert _rollout({**result, "machine": {**result["machine"], "cuda": True}}).startswith("HF engine on the host CPU: hf ")
    on_gpu = {**result, "config": {**result["config"], "hf_device": "cuda"}}
    assert _rollout(on_gpu).startswith("HF engine on cuda: hf ")
    # results written before --device carry no hf_device: their HF engine ran on the CPU
    older = {**result, "config": {k: v for k, v in result["config"].items() if k != "hf_device"},
             "machine": {**result["machine"], "cuda": True}}
    assert _rollout(older).startswith("HF engine on the host CPU: ")
