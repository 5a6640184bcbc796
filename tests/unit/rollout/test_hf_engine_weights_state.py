"""HF rollout engine: in-place weight updates, their errors, the sleep/wake state machine, and the
engine factory."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from rollout_helpers import PAD, PROMPTS, prompt_batch, tiny_model, tiny_qwen2_config

from megarl.errors import ConfigError
from megarl.rollout import (
    EngineOptions,
    EngineState,
    RolloutStateError,
    SamplingParams,
    WeightUpdateError,
    create_rollout_engine,
    resolve_engine_name,
)
from megarl.rollout.hf_engine import HFRolloutEngine

pytestmark = pytest.mark.unit

OPTIONS = EngineOptions(pad_token_id=PAD, eos_token_ids=())
GREEDY = SamplingParams.make_greedy(6)


def perturbed_state(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + 0.3 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
    }


def test_update_weights_matches_a_model_built_with_those_weights() -> None:
    engine = HFRolloutEngine(tiny_model(seed=0), OPTIONS)
    before = engine.generate(prompt_batch(PROMPTS), GREEDY)
    new_state = perturbed_state(tiny_model(seed=0))
    assert engine.update_weights(new_state.items()) == len(new_state)
    after = engine.generate(prompt_batch(PROMPTS), GREEDY)
    assert not torch.equal(before["responses"], after["responses"])

    fresh = HFRolloutEngine.from_config(tiny_qwen2_config(), OPTIONS, state_dict=new_state)
    expected = fresh.generate(prompt_batch(PROMPTS), GREEDY)
    assert torch.equal(after["responses"], expected["responses"])
    torch.testing.assert_close(after["rollout_log_probs"], expected["rollout_log_probs"], atol=1e-6, rtol=0)
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, new_state[name]), name


def test_partial_update_changes_only_the_named_tensor() -> None:
    engine = HFRolloutEngine(tiny_model(seed=0), OPTIONS)
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    name = "model.layers.1.mlp.down_proj.weight"
    engine.update_weights([(name, torch.zeros_like(old[name]))])
    for key, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, torch.zeros_like(tensor) if key == name else old[key]), key


def test_bfloat16_engine_takes_float32_updates() -> None:
    engine = HFRolloutEngine(tiny_model(seed=0), EngineOptions(pad_token_id=PAD, eos_token_ids=(), dtype="bfloat16"))
    name = "lm_head.weight"
    value = torch.randn(engine.model.state_dict()[name].shape)
    engine.update_weights([(name, value)])
    assert engine.model.state_dict()[name].dtype == torch.bfloat16
    assert torch.equal(engine.model.state_dict()[name], value.to(torch.bfloat16))


def test_tied_lm_head_name_is_accepted() -> None:
    engine = HFRolloutEngine(tiny_model(seed=0, tie_word_embeddings=True), OPTIONS)
    value = torch.randn(engine.model.state_dict()["lm_head.weight"].shape)
    engine.update_weights([("lm_head.weight", value)])
    assert torch.equal(engine.model.get_input_embeddings().weight, value)


def test_unknown_name_and_wrong_shape_name_the_parameter() -> None:
    engine = HFRolloutEngine(tiny_model(seed=0), OPTIONS)
    with pytest.raises(WeightUpdateError, match=r"unknown parameter 'model\.layers\.0\.self_attn\.qkv_proj\.weight'.*q_proj"):
        engine.update_weights([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(3))])
    with pytest.raises(WeightUpdateError, match=r"'model\.norm\.weight' has shape \(64,\), the update gives \(65,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(65))])


def test_sleep_wake_state_machine() -> None:
    # Level 1 keeps the weights (level 2 is covered in test_hf_engine_sleep_levels.py).
    engine = HFRolloutEngine(tiny_model(seed=0), EngineOptions(pad_token_id=PAD, eos_token_ids=(), sleep_level=1))
    expected = engine.generate(prompt_batch(PROMPTS), GREEDY)
    assert engine.state is EngineState.AWAKE and not engine.sleep_frees_memory  # CPU: nothing to free
    engine.sleep()
    assert engine.state is EngineState.ASLEEP
    with pytest.raises(RolloutStateError, match="cannot generate while asleep"):
        engine.generate(prompt_batch(PROMPTS), GREEDY)
    with pytest.raises(RolloutStateError, match="cannot update weights while asleep"):
        engine.update_weights([])
    with pytest.raises(RolloutStateError, match="weights before"):
        engine.wake_up(("kv_cache",))
    with pytest.raises(ValueError, match="subset of"):
        engine.wake_up(("activations",))
    engine.wake_up(("weights",))
    assert engine.state is EngineState.WEIGHTS_ONLY
    engine.update_weights([])  # allowed with weights resident
    with pytest.raises(RolloutStateError, match="cannot generate while weights_only"):
        engine.generate(prompt_batch(PROMPTS), GREEDY)
    engine.wake_up()
    assert engine.state is EngineState.AWAKE
    assert torch.equal(engine.generate(prompt_batch(PROMPTS), GREEDY)["responses"], expected["responses"])
    engine.release()
    assert engine.state is EngineState.RELEASED
    for action in (lambda: engine.generate(prompt_batch(PROMPTS), GREEDY), engine.sleep, engine.wake_up):
        with pytest.raises(RolloutStateError, match="released"):
            action()


def test_hf_engine_refuses_tensor_parallel() -> None:
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=2"):
        HFRolloutEngine(tiny_model(), EngineOptions(pad_token_id=PAD, eos_token_ids=(), tensor_parallel_size=2))


def test_factory_resolves_names() -> None:
    assert resolve_engine_name("hf")[0] == "hf"
    with pytest.raises(ConfigError, match="rollout.engine must be one of"):
        resolve_engine_name("sglang")
    if importlib.util.find_spec("vllm") is None:
        chosen, reason = resolve_engine_name("auto")
        assert chosen == "hf" and "vllm is not importable" in reason
        with pytest.raises(ConfigError, match="vllm cannot be imported"):
            resolve_engine_name("vllm")
    else:
        assert resolve_engine_name("auto") == ("vllm", "rollout.engine=auto and vllm is importable")


def test_factory_builds_the_hf_engine_from_a_saved_model(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model(seed=0)
    model.save_pretrained(tmp_path / "model")
    with caplog.at_level(logging.INFO, logger="megarl.rollout.factory"):
        engine = create_rollout_engine("hf", tmp_path / "model", OPTIONS)
    assert "rollout engine: hf (rollout.engine=hf)" in caplog.text
    assert engine.selection_reason == "rollout.engine=hf"
    direct = HFRolloutEngine(model, OPTIONS).generate(prompt_batch(PROMPTS), GREEDY)
    assert torch.equal(engine.generate(prompt_batch(PROMPTS), GREEDY)["responses"], direct["responses"])


def test_tensor_parallel_vllm_needs_an_initialised_process_group(tmp_path: Path) -> None:
    import torch.distributed as dist

    from megarl.rollout.vllm_engine import VLLMRolloutEngine

    if dist.is_initialized():
        pytest.skip("this process already has a torch.distributed group")
    # Checked before vllm is imported, so this runs without vllm too.
    with pytest.raises(ConfigError, match="needs torch.distributed to be initialised"):
        VLLMRolloutEngine(tmp_path, EngineOptions(pad_token_id=PAD, eos_token_ids=(), tensor_parallel_size=2))
