"""Llama 3.x RoPE scaling (HF `rope_type: llama3`) is mapped; HF biases megarl does not map
(`attention_bias: true`, which transformers puts on o_proj as well as q/k/v, and Llama's
`mlp_bias: true`) are refused by name, in the worker's spec and in the check that runs before any
worker starts. The engine's log-probs with the scaling equal transformers' in
tests/distributed/test_engine_hf_parity.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from megarl.config.model_files import model_dir_problems
from megarl.errors import ConfigError
from megarl.models.spec import ModelSpec

pytestmark = pytest.mark.unit

# Llama-3.1-8B-Instruct's config.json (public values).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _write(tmp_path: Path, config: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_llama_31_8b_config_is_accepted_with_its_rope_scaling(tmp_path: Path) -> None:
    model_dir = _write(tmp_path, LLAMA_31_8B)
    spec = ModelSpec.from_hf_config(model_dir)
    assert spec.family == "llama" and spec.rotary_base == 500000.0 and spec.max_position_embeddings == 131072
    assert spec.rope_scaling == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192.0}
    spec.check_layout(tp=4, pp=1)  # configs/ppo_llama3.1_8b_gsm8k.yaml's actor layout
    assert model_dir_problems(model_dir, "model.path", need_weights=False, family=None) == []


def _hf_inv_freq(**rope: object) -> torch.Tensor:
    config = transformers.LlamaConfig(**SMALL, rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", **rope))
    return LlamaRotaryEmbedding(config).inv_freq


@pytest.mark.parametrize("rope", [
    # Llama 3.1 / 3.3 and Llama 3.2's constants, then a short original context that scales, interpolates
    # and keeps frequencies of this head size.
    dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
    dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
    dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=3.0, original_max_position_embeddings=64),
])
def test_scaled_inverse_frequencies_equal_transformers(rope: dict) -> None:
    hf_config = transformers.LlamaConfig(**SMALL, rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", **rope))
    spec = ModelSpec.from_hf_config(hf_config.to_dict())  # transformers 5 writes rope_parameters
    dim = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    plain = 1.0 / (spec.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    want = _hf_inv_freq(**rope)
    got = spec.scaled_inv_freq(plain)
    assert torch.equal(got, want), (got, want)
    assert not torch.equal(got, plain)  # the scaling changed frequencies of this head size


def test_llama_31_constants_equal_megatron_cores_own_scaling() -> None:
    """Megatron-Core's rope_scaling (factor only; 1, 4 and 8192 fixed) gives the same frequencies for
    Llama 3.1's config as megarl's scaling, which takes every constant from the config."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    spec = ModelSpec.from_hf_config(LLAMA_31_8B)
    kv = spec.config_values["kv_channels"]
    plain = RotaryEmbedding(kv, 1.0, rotary_base=500000, use_cpu_initialization=True).inv_freq
    megatron = RotaryEmbedding(kv, 1.0, rotary_base=500000, rope_scaling=True, rope_scaling_factor=8.0,
                               use_cpu_initialization=True).inv_freq
    assert torch.equal(spec.scaled_inv_freq(plain), megatron)


def test_rope_scaling_spellings_and_original_context() -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    base = {k: v for k, v in LLAMA_31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    new_style = ModelSpec.from_hf_config({**base, "rope_parameters": {**rope, "rope_theta": 500000.0}})
    assert new_style.rotary_base == 500000.0 and new_style.rope_scaling["factor"] == 8.0
    legacy = ModelSpec.from_hf_config({**base, "rope_theta": 1e4, "rope_scaling": {**rope, "type": "llama3"}})
    assert legacy.rotary_base == 1e4
    # As transformers: a top-level original_max_position_embeddings wins; without any, max_position_embeddings.
    top = ModelSpec.from_hf_config({**base, "original_max_position_embeddings": 4096, "rope_scaling": rope})
    assert top.rope_scaling["original_max_position_embeddings"] == 4096
    no_orig = {k: v for k, v in rope.items() if k != "original_max_position_embeddings"}
    fallback = ModelSpec.from_hf_config({**base, "rope_scaling": no_orig})
    assert fallback.rope_scaling["original_max_position_embeddings"] == 131072
    assert ModelSpec.from_hf_config({**base, "rope_scaling": None}).rope_scaling is None


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "yarn", "factor": 4.0}, "HF config rope_scaling.rope_type = 'yarn' is not supported; "
                                           "valid: ['default', 'llama3']"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0},
     "HF config rope_scaling with rope_type 'llama3' lacks ['low_freq_factor']; it needs ['factor', "
     "'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings']"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0},
     "high_freq_factor = 4.0 <= low_freq_factor = 4.0; valid: positive numbers"),
    ({"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     "rope_type 'llama3': factor = '8'; valid: positive numbers"),
])
def test_unmapped_rope_settings_are_refused_by_name(tmp_path: Path, rope: dict, message: str) -> None:
    config = {**LLAMA_31_8B, "rope_scaling": rope}
    with pytest.raises(ConfigError) as err:
        ModelSpec.from_hf_config(config)
    assert str(err.value).startswith("model spec llama.yaml: ") and message in str(err.value)
    # Before any worker starts, naming the file.
    model_dir = _write(tmp_path, config)
    problems = model_dir_problems(model_dir, "model.path", need_weights=False, family=None)
    assert len(problems) == 1 and problems[0].startswith(f"model.path: {model_dir / 'config.json'}: ")
    assert message in problems[0]


@pytest.mark.parametrize("name,family,key,parts", [
    ("Llama", "llama", "attention_bias", "q_proj, k_proj, v_proj and o_proj"),
    ("Llama", "llama", "mlp_bias", "gate_proj, up_proj and down_proj"),
    ("Qwen3", "qwen3", "attention_bias", "q_proj, k_proj, v_proj and o_proj"),
    ("Qwen3Moe", "qwen3_moe", "attention_bias", "q_proj, k_proj, v_proj and o_proj"),
])
def test_unmapped_biases_are_refused_by_name(tmp_path: Path, name: str, family: str, key: str, parts: str) -> None:
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if family == "qwen3_moe" else {}
    config = getattr(transformers, f"{name}Config")(**SMALL, **extra, **{key: True}).to_dict()
    # transformers builds the biases megarl would drop: the reason for the refusal.
    hf_model = getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**config))
    proj = "self_attn.o_proj" if key == "attention_bias" else "mlp.down_proj"
    assert f"model.layers.0.{proj}.bias" in dict(hf_model.named_parameters())
    with pytest.raises(ConfigError) as err:
        ModelSpec.from_hf_config(config)
    msg = str(err.value)
    assert msg.startswith(f"model spec {family}.yaml: HF config {key}=True is not supported; valid: [False, None] "
                          f"(transformers then puts a bias on {parts}"), msg
    model_dir = _write(tmp_path, config)
    for spec_name in (None, family):  # found by model_type, or named by model.spec
        problems = model_dir_problems(model_dir, "model.path", need_weights=False, family=spec_name)
        assert problems == [f"model.path: {model_dir / 'config.json'}: {msg}"], problems
    # false (the default) and an absent key are accepted.
    ModelSpec.from_hf_config({**config, key: False})
    ModelSpec.from_hf_config({k: v for k, v in config.items() if k != key})
    assert model_dir_problems(_write(tmp_path / "ok", {**config, key: False}), "model.path", need_weights=False,
                              family=None) == []


def test_families_with_mapped_or_no_attention_bias_are_unchanged() -> None:
    qwen2 = ModelSpec.from_hf_config(transformers.Qwen2Config(**SMALL).to_dict())
    assert qwen2.features["qkv_bias"]  # Qwen2: q/k/v biases, no o_proj bias in transformers
    assert "decoder.layers.{layer}.self_attention.linear_qkv.bias" in [e.megatron for e in qwen2.active_weight_entries()]
    for name in ("Llama", "Qwen3"):
        spec = ModelSpec.from_hf_config(getattr(transformers, f"{name}Config")(**SMALL).to_dict())
        assert not spec.features["qkv_bias"] and not spec.transformer_config().add_bias_linear
        assert not any(e.megatron.endswith(".bias") for e in spec.weight_map)


@pytest.mark.parametrize("name", ["Llama", "Mistral", "Qwen2", "Qwen3", "Qwen2Moe", "Qwen3Moe"])
def test_partial_rotary_factor_is_ignored_as_transformers_ignores_it(name: str) -> None:
    """`partial_rotary_factor` is not mapped: transformers' models of these families rotate every
    dimension of a head whatever it says (their RoPE never reads it), and so does megarl's. Should
    transformers start honouring it, this fails and the spec must map it (Megatron's rotary_percent)."""
    module = __import__(f"transformers.models.{name.lower().replace('moe', '_moe')}."
                        f"modeling_{name.lower().replace('moe', '_moe')}", fromlist=["x"])
    config_cls, rotary_cls = getattr(transformers, f"{name}Config"), getattr(module, f"{name}RotaryEmbedding")
    full = rotary_cls(config_cls(**SMALL, head_dim=16)).inv_freq
    partial = rotary_cls(config_cls(**SMALL, head_dim=16, partial_rotary_factor=0.5)).inv_freq
    assert full.numel() == 8 and torch.equal(partial, full)
    ModelSpec.from_hf_config(config_cls(**SMALL, head_dim=16, partial_rotary_factor=0.5).to_dict())  # accepted


def test_mistral_never_maps_attention_biases() -> None:
    """transformers' Mistral builds no q/k/v bias whatever `attention_bias` says; the spec follows it."""
    config = transformers.MistralConfig(**SMALL, attention_bias=True).to_dict()
    hf_model = transformers.MistralForCausalLM(transformers.MistralConfig(**config))
    assert not any(name.endswith(".bias") for name, _ in hf_model.named_parameters())
    spec = ModelSpec.from_hf_config(config)
    assert not spec.features["qkv_bias"]
