"""After its weights were discarded (a level-2 sleep) or damaged (a verified in-place sync that
found a changed bucket after writing it), an engine generates again only once every weight was
rewritten: a partial update is not enough (the vLLM engine counted any update as complete)."""

from __future__ import annotations

import json
import types

import pytest
import torch
from rollout_helpers import PAD, PROMPTS, prompt_batch, tiny_model

from megarl.rollout import EngineOptions, RolloutStateError, SamplingParams
from megarl.rollout.hf_engine import HFRolloutEngine
from megarl.hybrid.slices import engine_params, hf_tensor_shapes
from megarl.models.spec import ModelSpec
from megarl.rollout.vllm_engine import VLLMRolloutEngine, hf_parameter_layout

pytestmark = pytest.mark.unit

GREEDY = SamplingParams.make_greedy(4)
SHAPES = {"model.embed_tokens.weight": (4, 2), "model.norm.weight": (2,), "lm_head.weight": (4, 2)}


def vllm_engine_object(model_path: str = "model", shapes: dict | None = None,
                       tied: dict | None = None) -> VLLMRolloutEngine:
    """A VLLMRolloutEngine whose vLLM parts are stand-ins: vLLM's CPU build has no sleep mode, so
    only the engine's own bookkeeping around `llm.sleep`/`wake_up`/`load_weights` runs here."""
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    VLLMRolloutEngine.__mro__[1].__init__(engine, EngineOptions(pad_token_id=0, eos_token_ids=(1,), sleep_level=2))
    engine.model_path, engine._sleep_supported = model_path, True
    engine._expected_shapes, engine._tied_names = dict(SHAPES if shapes is None else shapes), dict(tied or {})
    engine._expert_staging, engine._unwritten = {}, set()
    loaded: list[str] = []
    model = types.SimpleNamespace(load_weights=lambda items: loaded.extend(name for name, _ in items),
                                  named_modules=lambda: [])
    engine.engine_model = lambda: model
    engine.llm = types.SimpleNamespace(sleep=lambda level: None, wake_up=lambda tags: None,
                                       reset_prefix_cache=lambda: None)
    return engine


def test_vllm_engine_after_a_discarding_sleep_needs_every_weight() -> None:
    engine = vllm_engine_object()
    engine.sleep()
    engine.wake_up(("weights",))
    assert engine.needs_weight_sync
    engine.update_weights([("model.norm.weight", torch.zeros(2))])
    assert engine.needs_weight_sync  # one of three: before, this counted as a whole update
    engine.wake_up()
    with pytest.raises(RolloutStateError, match="still missing 2: lm_head.weight, model.embed_tokens.weight"):
        engine._require_generate()
    engine.update_weights([("model.embed_tokens.weight", torch.zeros(4, 2)), ("lm_head.weight", torch.zeros(4, 2))])
    assert not engine.needs_weight_sync


def test_vllm_engine_tied_model_whole_after_the_sync_plan_names(tmp_path) -> None:
    """At rollout TP 1 a weight sync gives the HF names of the resharding plan, which names a tied
    embedding once (model.embed_tokens.weight): that makes a tied model whole again. Before, the
    engine waited for lm_head.weight as well and refused to generate from the second step on."""
    config = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=150, hidden_size=32,
                  intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes, tied = hf_parameter_layout(tmp_path)
    assert tied == {"lm_head.weight": "model.embed_tokens.weight"} and "lm_head.weight" in shapes
    spec = ModelSpec.from_hf_config(str(tmp_path))
    plan_names = [param.name for param in engine_params(spec, "hf", 0, 1, hf_tensor_shapes(spec))]
    assert "lm_head.weight" not in plan_names
    engine = vllm_engine_object(str(tmp_path), shapes, tied)
    engine.sleep()
    engine.wake_up(("weights",))
    engine.update_weights([(name, torch.zeros(shapes[name])) for name in plan_names])
    engine.wake_up()
    assert not engine.needs_weight_sync
    engine._require_generate()
    # The tied name alone also counts for the tensor it shares.
    engine.mark_weights_damaged()
    engine.update_weights([(name, torch.zeros(shapes[name])) for name in plan_names
                           if name != "model.embed_tokens.weight"] + [("lm_head.weight", torch.zeros(shapes["lm_head.weight"]))])
    assert not engine.needs_weight_sync


def test_vllm_engine_damaged_by_a_failed_sync_needs_every_weight() -> None:
    engine = vllm_engine_object()
    engine.mark_weights_damaged()
    engine.update_weights([("model.norm.weight", torch.zeros(2))])
    assert engine.needs_weight_sync
    engine.mark_weights_updated()  # a whole in-place copy
    assert not engine.needs_weight_sync


def test_hf_engine_damaged_generates_again_only_after_a_whole_update() -> None:
    engine = HFRolloutEngine(tiny_model(seed=0), EngineOptions(pad_token_id=PAD, eos_token_ids=()))
    state = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    engine.mark_weights_damaged()
    with pytest.raises(RolloutStateError, match="weights were discarded"):
        engine.generate(prompt_batch(PROMPTS), GREEDY)
    engine.update_weights([("model.norm.weight", state["model.norm.weight"])])
    assert engine.needs_weight_sync
    engine.update_weights(state.items())
    assert not engine.needs_weight_sync
    assert engine.generate(prompt_batch(PROMPTS), GREEDY)["responses"].shape[0] == len(PROMPTS)
