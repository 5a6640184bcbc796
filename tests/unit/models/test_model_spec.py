"""Model specs: HF config -> TransformerConfig fields, family choice, errors."""

from __future__ import annotations

import pytest
import transformers

from megarl.errors import ConfigError
from megarl.models.spec import ModelSpec, supported_model_types


def _cfg(name: str, **kw: object) -> transformers.PretrainedConfig:
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128, head_dim=8)
    base.update(kw)
    return getattr(transformers, f"{name}Config")(**base)


@pytest.mark.parametrize("name,family,bias,qk_norm", [
    ("Llama", "llama", False, False), ("Qwen2", "qwen2", True, False),
    ("Qwen3", "qwen3", False, True), ("Mistral", "mistral", False, False),
])
def test_family_and_config_mapping(name: str, family: str, bias: bool, qk_norm: bool) -> None:
    spec = ModelSpec.from_hf_config(_cfg(name, rope_theta=12345.0))
    assert spec.family == family
    v = spec.config_values
    assert (v["num_layers"], v["hidden_size"], v["ffn_hidden_size"]) == (4, 64, 96)
    assert (v["num_attention_heads"], v["num_query_groups"], v["kv_channels"]) == (8, 2, 8)
    assert spec.features == {"qkv_bias": bias, "qk_layernorm": qk_norm, "untied_embeddings": True,
                             "scalar_head": False}
    assert spec.rotary_base == 12345.0 and spec.vocab_size == 300


def test_llama_tied_embeddings_follow_the_config() -> None:
    spec = ModelSpec.from_hf_config(_cfg("Llama", tie_word_embeddings=True).to_dict())
    assert spec.tie_embeddings and not spec.features["untied_embeddings"] and not spec.features["qkv_bias"]
    names = [e.megatron for e in spec.active_weight_entries()]
    assert "output_layer.weight" not in names
    # (attention_bias: true is refused: test_model_spec_rope_and_bias.py)


def test_transformer_config_for_cpu() -> None:
    spec = ModelSpec.from_hf_config(_cfg("Qwen3", head_dim=32))
    tc = spec.transformer_config(tp=2, pp=2)
    assert tc.kv_channels == 32 and tc.qk_layernorm and tc.num_query_groups == 2
    assert tc.tensor_model_parallel_size == 2 and tc.pipeline_model_parallel_size == 2
    assert tc.gated_linear_unit and tc.normalization == "RMSNorm" and not tc.add_bias_linear
    assert tc.use_cpu_initialization and not tc.gradient_accumulation_fusion


def test_sequence_parallel_and_recompute_map_to_megatron_settings() -> None:
    spec = ModelSpec.from_hf_config(_cfg("Qwen2"))
    plain = spec.transformer_config(tp=2)
    assert not plain.sequence_parallel and plain.recompute_granularity is None
    full = spec.transformer_config(tp=2, sequence_parallel=True, recompute_granularity="full")
    assert full.sequence_parallel
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    selective = spec.transformer_config(recompute_granularity="selective")
    assert selective.recompute_granularity == "selective" and selective.recompute_method is None
    assert selective.recompute_modules == ["core_attn"]


def test_padded_vocab() -> None:
    spec = ModelSpec.from_hf_config(_cfg("Llama"))
    assert spec.padded_vocab_size(1) == 384 and spec.padded_vocab_size(2) == 512


def test_unsupported_architecture_lists_supported_ones() -> None:
    with pytest.raises(ConfigError) as err:
        ModelSpec.from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    for model_type in ("llama", "qwen2", "qwen3", "mistral"):
        assert model_type in str(err.value)
    assert {"llama", "qwen2", "qwen3", "mistral"} <= set(supported_model_types())


def test_bad_layout_and_activation_are_refused() -> None:
    spec = ModelSpec.from_hf_config(_cfg("Llama"))
    with pytest.raises(ConfigError, match="tp=4"):
        spec.check_layout(4, 1)  # 2 key/value heads
    with pytest.raises(ConfigError, match="pp=3"):
        spec.check_layout(1, 3)
    with pytest.raises(ConfigError, match="hidden_act"):
        ModelSpec.from_hf_config(_cfg("Llama", hidden_act="gelu"))
    with pytest.raises(ConfigError, match="rope_type"):
        ModelSpec.from_hf_config({**_cfg("Llama").to_dict(), "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


def _moe_cfg(name: str, **kw: object) -> dict:
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24)
    base.update(kw)
    return getattr(transformers, f"{name}Config")(**base).to_dict()


@pytest.mark.parametrize("norm_topk,pre_softmax", [(True, False), (False, True)])
def test_qwen3_moe_maps_experts_and_routing(norm_topk: bool, pre_softmax: bool) -> None:
    spec = ModelSpec.from_hf_config(_moe_cfg("Qwen3Moe", head_dim=8, norm_topk_prob=norm_topk))
    v = spec.config_values
    assert spec.family == "qwen3_moe" and spec.num_experts == 8 and spec.features["qk_layernorm"]
    assert (v["moe_router_topk"], v["moe_ffn_hidden_size"]) == (2, 24)
    # HF: softmax, top-k, renormalise (norm_topk_prob) == Megatron: top-k then softmax.
    assert v["moe_router_pre_softmax"] is pre_softmax
    tc = spec.transformer_config(tp=2, ep=4)
    assert tc.num_moe_experts == 8 and tc.expert_model_parallel_size == 4
    assert tc.moe_aux_loss_coeff == 0.0 and not tc.moe_grouped_gemm and tc.moe_token_dispatcher_type == "alltoall"


def test_qwen2_moe_has_a_gated_shared_expert_and_qkv_bias() -> None:
    spec = ModelSpec.from_hf_config(_moe_cfg("Qwen2Moe", shared_expert_intermediate_size=40))
    v = spec.config_values
    assert spec.family == "qwen2_moe" and spec.features["qkv_bias"]
    assert v["moe_shared_expert_intermediate_size"] == 40 and v["moe_shared_expert_gate"] is True
    assert v["moe_router_pre_softmax"] is True  # Qwen2-MoE does not renormalise the top-k weights
    names = [e.megatron for e in spec.active_weight_entries()]
    assert "decoder.layers.{layer}.mlp.shared_experts.gate_weight" in names


def test_moe_layouts_and_unmapped_settings_are_refused() -> None:
    spec = ModelSpec.from_hf_config(_moe_cfg("Qwen3Moe", head_dim=8))
    with pytest.raises(ConfigError, match="ep=3"):
        spec.check_layout(1, 1, 3)  # 8 experts
    with pytest.raises(ConfigError, match="moe_intermediate_size=24"):
        spec.check_layout(16, 1)
    spec.check_layout(2, 2, 8)
    with pytest.raises(ConfigError, match="decoder_sparse_step=2.*every decoder layer"):
        ModelSpec.from_hf_config(_moe_cfg("Qwen3Moe", decoder_sparse_step=2))
    with pytest.raises(ConfigError, match=r"mlp_only_layers=\[1\]"):
        ModelSpec.from_hf_config(_moe_cfg("Qwen2Moe", mlp_only_layers=[1]))
    dense = ModelSpec.from_hf_config(_cfg("Llama"))
    with pytest.raises(ConfigError, match="dense"):
        dense.check_layout(1, 1, 2)


def test_moe_families_are_listed_as_supported() -> None:
    assert {"qwen2_moe", "qwen3_moe"} <= set(supported_model_types())
    with pytest.raises(ConfigError) as err:
        ModelSpec.from_hf_config({"model_type": "deepseek_v3"})
    assert "qwen3_moe" in str(err.value)


@pytest.mark.parametrize("content, problem", [("{not json", "not a JSON HF config"),
                                              ("[1, 2]", "a HF config is a JSON object, got a list")])
def test_a_config_file_that_is_not_a_json_object_is_a_config_error(tmp_path, content: str, problem: str) -> None:
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError, match=f"config.json: {problem}"):
        ModelSpec.from_hf_config(tmp_path)
