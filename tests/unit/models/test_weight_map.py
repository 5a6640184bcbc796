"""Weight map: fusion layouts against explicit loops; HF <-> Megatron round trips at any TP x PP."""

from __future__ import annotations

import pytest
import torch
import transformers

from megarl.errors import ConfigError
from megarl.models.spec import ModelSpec
from megarl.models.weight_map import fuse, hf_to_megatron_state_dict, megatron_to_hf_state_dict, tp_shard, unfuse


def _spec(tie: bool = False, name: str = "Qwen2") -> ModelSpec:
    cfg = getattr(transformers, f"{name}Config")(
        vocab_size=150, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tie)
    return ModelSpec.from_hf_config(cfg)


def _entry(spec: ModelSpec, fusion: str) -> object:
    return next(e for e in spec.weight_map if e.fusion == fusion)


def test_qkv_fused_per_query_group() -> None:
    spec = _spec()  # 4 heads of 8, 2 groups: per group [q_h0, q_h1, k_g, v_g]
    q, k, v = torch.randn(32, 32), torch.randn(16, 32), torch.randn(16, 32)
    fused = fuse(_entry(spec, "qkv_per_group"), [q, k, v], spec)
    rows = []
    for g in range(2):
        for h in range(2):
            rows.append(q[(2 * g + h) * 8:(2 * g + h + 1) * 8])
        rows.append(k[g * 8:(g + 1) * 8])
        rows.append(v[g * 8:(g + 1) * 8])
    assert torch.equal(fused, torch.cat(rows))
    back = unfuse(_entry(spec, "qkv_per_group"), fused, spec)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v]))
    # TP=2: each rank holds one whole group.
    assert torch.equal(tp_shard(_entry(spec, "qkv_per_group"), fused, 1, 2), torch.cat(rows[4:]))


def test_gate_up_split_per_rank() -> None:
    spec = _spec()
    gate, up = torch.randn(48, 32), torch.randn(48, 32)
    entry = _entry(spec, "gate_up")
    fused = fuse(entry, [gate, up], spec)
    for r in range(2):
        want = torch.cat([gate[r * 24:(r + 1) * 24], up[r * 24:(r + 1) * 24]])
        assert torch.equal(tp_shard(entry, fused, r, 2), want)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_through_megatron_shards(tp: int, pp: int, tie: bool) -> None:
    spec = _spec(tie)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(spec_config := transformers.Qwen2Config(**{
        k: spec.hf_config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")}))
    hf_sd = {k: v.clone() for k, v in model.state_dict().items()}
    shards = [[hf_to_megatron_state_dict(hf_sd, spec, t, tp, p, pp) for t in range(tp)] for p in range(pp)]
    emb = shards[0][0]["embedding.word_embeddings.weight"]
    assert emb.shape == (spec.padded_vocab_size(tp) // tp, 32)
    if tp == 1:
        assert torch.all(emb[150:] == 0)  # vocab padding rows
    # Layers are renumbered per stage: stage p holds global layers 2p, 2p+1 as 0, 1.
    if pp == 2:
        assert "decoder.layers.1.mlp.linear_fc2.weight" in shards[1][0]
        assert "decoder.layers.2.mlp.linear_fc2.weight" not in shards[1][0]
        want = hf_sd["model.layers.3.mlp.down_proj.weight"].chunk(tp, dim=1)[0]
        assert torch.equal(shards[1][0]["decoder.layers.1.mlp.linear_fc2.weight"], want)
        assert ("output_layer.weight" in shards[1][0]) and "embedding.word_embeddings.weight" not in shards[1][0]
    back = megatron_to_hf_state_dict(shards, spec)
    expected = {k: v for k, v in hf_sd.items() if not (tie and k == "lm_head.weight")}
    assert set(back) == set(expected)
    for k, v in expected.items():
        assert torch.equal(back[k], v), k
    del spec_config


def test_experts_expand_to_local_indices_per_expert_parallel_rank() -> None:
    import transformers

    from megarl.models.spec import ModelSpec
    from megarl.models.weight_map import stage_entries

    cfg = transformers.Qwen3MoeConfig(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
                                      moe_intermediate_size=24)
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    fc2 = "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight"
    # pp rank 1 of 2 holds layers 2 and 3 (local 0, 1); ep rank 2 of 3 holds experts 4 and 5 (local 0, 1).
    got = {name: hf for _, name, hf in stage_entries(spec, 1, 2, ep_rank=2, ep_size=3) if "linear_fc2" in name
           and "experts" in name}
    want = {fc2.format(local_layer, local_e): [f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"]
            for local_layer, layer in ((0, 2), (1, 3)) for local_e, e in ((0, 4), (1, 5))}
    assert got == want
    every = [hf for r in range(3) for _, name, hf in stage_entries(spec, 0, 1, ep_rank=r, ep_size=3) if "experts" in name]
    assert len(every) == len({tuple(h) for h in every}) == 4 * 6 * 2  # each HF expert tensor set exactly once
    with pytest.raises(ConfigError, match="ep=4"):
        stage_entries(spec, 0, 1, ep_rank=0, ep_size=4)


def test_per_expert_entry_needs_the_placeholder_on_both_sides() -> None:
    from megarl.models.weight_map import parse_weight_map

    with pytest.raises(ConfigError, match="one side only"):
        parse_weight_map([{"megatron": "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.w",
                           "hf": ["model.layers.{layer}.mlp.experts.0.w"]}], "test.yaml")
