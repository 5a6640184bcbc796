"""vLLM rollout engine (CPU build here, official vLLM on GPU) against HF transformers references.

One engine serves the whole module (starting it takes seconds). The tiny model uses head_dim 64:
the CPU build refuses smaller heads. References are uncached HF forwards in float64.
"""

from __future__ import annotations

import dataclasses

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its INFO/WARNING lines drown the test report
vllm = pytest.importorskip("vllm", reason="needs vLLM: build the CPU environment with tools/vllm_env.sh")

from megarl.data.padding import left_pad  # noqa: E402
from megarl.errors import ConfigError  # noqa: E402
from megarl.protocol import Batch  # noqa: E402
from megarl.rollout import (  # noqa: E402
    EngineOptions,
    EngineState,
    RolloutStateError,
    SamplingParams,
    WeightUpdateError,
    resolve_engine_name,
)
from megarl.rollout.hf_engine import HFRolloutEngine  # noqa: E402
from megarl.rollout.vllm_engine import VLLMRolloutEngine  # noqa: E402

pytestmark = pytest.mark.vllm

PAD = 0
R = 8
PROMPTS = [[5, 17, 42, 8], [33, 2], [71, 70, 69, 68, 67, 3]]
TOL = 1e-4  # fp32 vLLM vs transformers


def tiny_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, pad_token_id=PAD,
    )


def tiny_hf_model(seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32).eval()


def prompt_batch(prompts: list[list[int]]) -> Batch:
    input_ids, attention_mask, _ = left_pad(prompts, PAD)
    uids = [f"u{i}" for i in range(len(prompts))]
    return Batch.from_dict({"input_ids": input_ids, "attention_mask": attention_mask}, non_tensors={"uid": uids})


def kept(batch: Batch, row: int) -> list[int]:
    return batch["responses"][row][batch["response_mask"][row].bool()].tolist()


@torch.no_grad()
def reference_log_softmax(model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / temperature, dim=-1)


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return tiny_hf_model(seed=0)


@pytest.fixture(scope="module")
def engine(hf_model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMRolloutEngine]:
    model_dir: Path = tmp_path_factory.mktemp("vllm_model")
    hf_model.save_pretrained(model_dir)
    options = EngineOptions(
        pad_token_id=PAD, eos_token_ids=(), seed=0, max_model_len=128, max_num_seqs=64, kv_cache_memory_gb=0.25,
        sleep_level=1,  # these tests generate after a wake-up without a weight sync
    )
    engine = VLLMRolloutEngine(model_dir, options)
    yield engine
    engine.release()


def test_auto_picks_vllm_when_importable() -> None:
    assert resolve_engine_name("auto") == ("vllm", "rollout.engine=auto and vllm is importable")


def test_batch_contract_and_interleaving(engine: VLLMRolloutEngine) -> None:
    n = 3
    prompts = prompt_batch(PROMPTS)
    out = engine.generate(prompts, SamplingParams(n=n, max_new_tokens=R, seed=1))
    rows, p = len(PROMPTS) * n, prompts["input_ids"].shape[1]
    assert len(out) == rows
    assert tuple(out["responses"].shape) == (rows, R) and tuple(out["rollout_log_probs"].shape) == (rows, R)
    assert tuple(out["input_ids"].shape) == (rows, p + R) and tuple(out["position_ids"].shape) == (rows, p + R)
    assert list(out["uid"]) == [f"u{i}" for i in range(len(PROMPTS)) for _ in range(n)]
    for row in range(rows):
        assert torch.equal(out["prompts"][row], prompts["input_ids"][row // n])
        assert torch.equal(out["input_ids"][row, p:], out["responses"][row])
        assert out["response_mask"][row].tolist() == [1] * R  # no EOS configured
    # the n samples of one prompt are different samples
    assert len({tuple(out["responses"][j].tolist()) for j in range(n)}) > 1


def test_greedy_matches_the_hf_engine_and_reference(engine: VLLMRolloutEngine, hf_model: torch.nn.Module) -> None:
    out = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    hf_engine = HFRolloutEngine(hf_model, EngineOptions(pad_token_id=PAD, eos_token_ids=()))
    hf_out = hf_engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    assert torch.equal(out["responses"], hf_out["responses"])
    torch.testing.assert_close(out["rollout_log_probs"], hf_out["rollout_log_probs"], atol=TOL, rtol=0)
    for i, prompt in enumerate(PROMPTS):
        response = out["responses"][i].tolist()
        reference = reference_log_softmax(hf_model, prompt, response)
        torch.testing.assert_close(
            out["rollout_log_probs"][i].double(), reference[torch.arange(R), torch.tensor(response)], atol=TOL, rtol=0
        )


def test_tempered_log_probs_follow_the_processed_convention(engine: VLLMRolloutEngine, hf_model: torch.nn.Module) -> None:
    n, temperature = 2, 0.7
    out = engine.generate(prompt_batch(PROMPTS), SamplingParams(n=n, temperature=temperature, max_new_tokens=R, seed=4))
    for row in range(len(out)):
        response = kept(out, row)
        reference = reference_log_softmax(hf_model, PROMPTS[row // n], response, temperature)
        expected = reference[torch.arange(len(response)), torch.tensor(response)]
        torch.testing.assert_close(out["rollout_log_probs"][row, : len(response)].double(), expected, atol=TOL, rtol=0)


def test_top_k_log_probs_are_renormalised_like_the_hf_engine(engine: VLLMRolloutEngine, hf_model: torch.nn.Module) -> None:
    n, k = 2, 4
    out = engine.generate(prompt_batch(PROMPTS), SamplingParams(n=n, top_k=k, max_new_tokens=R, seed=9))
    for row in range(len(out)):
        response = kept(out, row)
        reference = reference_log_softmax(hf_model, PROMPTS[row // n], response)
        for t, token in enumerate(response):
            top = torch.topk(reference[t], k)
            assert token in top.indices.tolist()
            expected = reference[t, token] - torch.logsumexp(top.values, dim=0)
            assert out["rollout_log_probs"][row, t].item() == pytest.approx(expected.item(), abs=TOL)


def test_seed_reproduces(engine: VLLMRolloutEngine) -> None:
    params = SamplingParams(n=2, max_new_tokens=R, seed=21)
    first = engine.generate(prompt_batch(PROMPTS), params)
    again = engine.generate(prompt_batch(PROMPTS), params)
    other = engine.generate(prompt_batch(PROMPTS), SamplingParams(n=2, max_new_tokens=R, seed=22))
    assert torch.equal(first["responses"], again["responses"])
    assert not torch.equal(first["responses"], other["responses"])


def test_a_call_on_some_prompts_samples_them_as_the_call_on_all(engine: VLLMRolloutEngine) -> None:
    """`prompt_indices` (an agent loop's later turns, a partial rollout's open rows): each prompt keeps
    the random stream of its index in the whole batch; `row_offset` shifts it as a DP shard's start."""
    params = SamplingParams(n=2, max_new_tokens=R, seed=21)
    whole = engine.generate(prompt_batch(PROMPTS), params)
    last = len(PROMPTS) - 1
    some = engine.generate(prompt_batch([PROMPTS[last]]), params.for_prompts(len(PROMPTS), [last]))
    assert torch.equal(some["responses"], whole["responses"][2 * last:2 * last + 2])
    shard = engine.generate(prompt_batch([PROMPTS[last]]), dataclasses.replace(params, row_offset=last))
    assert torch.equal(shard["responses"], some["responses"])


def test_stop_token_ends_the_response_and_is_kept(engine: VLLMRolloutEngine) -> None:
    free = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    row1 = free["responses"][1].tolist()
    step = next(k for k in range(1, R) if row1[k] not in row1[:k])
    out = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R, stop_token_ids=[row1[step]]))
    assert out["responses"][1].tolist() == row1[: step + 1] + [PAD] * (R - step - 1)
    assert out["response_mask"][1].tolist() == [1] * (step + 1) + [0] * (R - step - 1)
    assert out["rollout_log_probs"][1, step + 1 :].abs().sum() == 0


def test_update_weights_in_place_matches_hf_with_the_new_weights(
    engine: VLLMRolloutEngine, hf_model: torch.nn.Module
) -> None:
    before = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    generator = torch.Generator().manual_seed(1)
    original = {name: tensor.clone() for name, tensor in hf_model.state_dict().items()}
    new_state = {name: t + 0.3 * torch.randn(t.shape, generator=generator) for name, t in original.items()}
    new_model = tiny_hf_model(seed=0)
    new_model.load_state_dict(new_state)
    try:
        assert engine.update_weights(new_state.items()) == len(new_state)
        after = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
        assert not torch.equal(after["responses"], before["responses"])
        expected = HFRolloutEngine(new_model, EngineOptions(pad_token_id=PAD, eos_token_ids=())).generate(
            prompt_batch(PROMPTS), SamplingParams.make_greedy(R)
        )
        assert torch.equal(after["responses"], expected["responses"])
        torch.testing.assert_close(after["rollout_log_probs"], expected["rollout_log_probs"], atol=TOL, rtol=0)
    finally:
        engine.update_weights(original.items())
    # the same prompts again: a stale prefix cache would replay the new weights' answers
    restored = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    assert torch.equal(restored["responses"], before["responses"])


def test_bad_updates_name_the_parameter_and_leave_the_engine_intact(engine: VLLMRolloutEngine) -> None:
    before = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    with pytest.raises(WeightUpdateError, match=r"unknown parameter 'model\.layers\.0\.self_attn\.qkv_proj\.weight'"):
        engine.update_weights([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(256, 128))])
    with pytest.raises(WeightUpdateError, match=r"'lm_head\.weight' has shape \(256, 128\), the update gives \(128, 256\)"):
        engine.update_weights([("lm_head.weight", torch.zeros(128, 256))])
    assert torch.equal(engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))["responses"], before["responses"])


def test_in_place_copy_into_engine_parameters_reaches_the_compute(
    engine: VLLMRolloutEngine, hf_model: torch.nn.Module
) -> None:
    # The CPU build repacks weights for oneDNN unless told not to; then copies would be ignored.
    name = "model.layers.1.mlp.down_proj.weight"
    parameter = dict(engine.engine_model().named_parameters())[name]
    original = parameter.detach().clone()
    generator = torch.Generator().manual_seed(2)
    new_value = original + 0.5 * torch.randn(original.shape, generator=generator)
    new_model = tiny_hf_model(seed=0)
    new_model.get_submodule("model.layers.1.mlp.down_proj").weight.data.copy_(new_value)
    before = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    try:
        with torch.no_grad():
            parameter.copy_(new_value)
        engine.mark_weights_updated()
        after = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
        expected = HFRolloutEngine(new_model, EngineOptions(pad_token_id=PAD, eos_token_ids=())).generate(
            prompt_batch(PROMPTS), SamplingParams.make_greedy(R)
        )
        assert not torch.equal(after["responses"], before["responses"])
        assert torch.equal(after["responses"], expected["responses"])
    finally:
        with torch.no_grad():
            parameter.copy_(original)
        engine.mark_weights_updated()


def test_in_place_targets_must_cover_every_engine_parameter(engine: VLLMRolloutEngine) -> None:
    # A vLLM-layout plan for this engine (rollout TP 1) names every parameter of its model; one that misses
    # a parameter is refused before anything is written (the sync would mark every weight updated).
    from megarl.hybrid.plan import build_reshard_plan
    from megarl.hybrid.sync import engine_targets
    from megarl.layout import ParallelLayout
    from megarl.models.spec import ModelSpec

    spec = ModelSpec.from_hf_config(engine.model_path)
    plan = build_reshard_plan(spec, ParallelLayout(dp=1), ParallelLayout.rollout(1, 1), "vllm")
    tensors = plan.engine_tensors[0]
    params = dict(engine.engine_model().named_parameters())
    assert set(engine_targets(engine, tensors)) == set(params)
    left_out = next(t for t in tensors if t.name.endswith("down_proj.weight"))
    with pytest.raises(ConfigError, match=rf"writes no values into 1 parameter.*{left_out.name}"):
        engine_targets(engine, [t for t in tensors if t is not left_out])


def test_state_machine(engine: VLLMRolloutEngine) -> None:
    before = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    engine.sleep()
    assert engine.state is EngineState.ASLEEP
    with pytest.raises(RolloutStateError, match="cannot generate while asleep"):
        engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    engine.wake_up(("weights",))
    engine.wake_up(("weights", "kv_cache"))
    assert engine.state is EngineState.AWAKE
    assert torch.equal(engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))["responses"], before["responses"])


def test_sleep_frees_memory_and_wakes_with_updated_weights(engine: VLLMRolloutEngine, hf_model: torch.nn.Module) -> None:
    if not engine.sleep_frees_memory:
        pytest.skip("vLLM sleep mode is not supported on this platform (the CPU build refuses it); the gpu tier covers it")
    before = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    engine.sleep()
    engine.wake_up(("weights",))
    engine.update_weights(hf_model.state_dict().items())  # level-1 sleep kept them; reload anyway
    engine.wake_up()
    assert torch.equal(engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))["responses"], before["responses"])


def test_a_bad_sleep_level_is_refused() -> None:
    with pytest.raises(ConfigError, match="sleep_level must be 1 or 2"):
        EngineOptions(pad_token_id=PAD, eos_token_ids=(), sleep_level=3)

