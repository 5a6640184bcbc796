"""HF -> Megatron -> HF round trips (bit-exact), and the checkpoint's layout checked by hand.

The layout reference below is written out plainly (loops over query groups), independent of the
weight map's fuse/unfuse. That the engine loads the checkpoint at TP=2 / PP=2 and matches
transformers is checked in tests/distributed/convert.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_hf import make_model, read_all, save_model

from megarl.convert.dcp_io import CheckpointReader
from megarl.convert.hf_to_mcore import convert_hf_to_mcore
from megarl.convert.mcore_to_hf import convert_mcore_to_hf


@pytest.mark.parametrize("kind,tp,pp", [
    ("llama", 1, 1), ("llama", 2, 2), ("llama_tied", 2, 1), ("qwen2", 2, 1), ("qwen2_tied", 1, 2),
    ("qwen3", 2, 2), ("mistral", 1, 1), ("qwen3_moe", 2, 2), ("qwen2_moe", 1, 1),
])
def test_round_trip_is_bit_exact_and_loads_in_transformers(kind: str, tp: int, pp: int, tmp_path: Path) -> None:
    import transformers

    model = make_model(kind, seed=1)
    src = save_model(model, tmp_path / "hf")
    convert_hf_to_mcore(src, tmp_path / "mcore", tp=tp, pp=pp, progress=False)
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)

    want, got = read_all(src), read_all(tmp_path / "back")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), f"{kind}: {name} differs"
    assert (tmp_path / "back" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert (tmp_path / "back" / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def _hand_fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, head_dim: int) -> torch.Tensor:
    """Megatron's QKV rows: for each query group, its query heads, then its key, then its value."""
    per_group = q.shape[0] // head_dim // groups
    rows = []
    for g in range(groups):
        for h in range(per_group):
            rows.append(q[(g * per_group + h) * head_dim:(g * per_group + h + 1) * head_dim])
        rows.append(k[g * head_dim:(g + 1) * head_dim])
        rows.append(v[g * head_dim:(g + 1) * head_dim])
    return torch.cat(rows, 0)


def test_checkpoint_holds_megatron_layout(tmp_path: Path) -> None:
    model = make_model("qwen3", seed=2, layers=3)
    hf = model.state_dict()
    src = save_model(model, tmp_path / "hf")
    convert_hf_to_mcore(src, tmp_path / "mcore", tp=2, progress=False)
    reader = CheckpointReader(tmp_path / "mcore")
    for layer in range(3):
        p = f"model.layers.{layer}."
        qkv = reader.read("decoder.layers.self_attention.linear_qkv.weight", (layer, 0, 0), (1, 128, 64))[0]
        want = _hand_fused_qkv(hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"],
                               hf[p + "self_attn.v_proj.weight"], groups=2, head_dim=16)
        assert torch.equal(qkv, want), f"layer {layer}: fused QKV rows out of order"
        fc1 = reader.read("decoder.layers.mlp.linear_fc1.weight", (layer, 0, 0), (1, 192, 64))[0]
        assert torch.equal(fc1, torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]))
        norms = {
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "decoder.layers.mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
            "decoder.layers.self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "decoder.layers.self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        }
        for key, hf_name in norms.items():
            width = hf[p + hf_name].shape[0]
            assert torch.equal(reader.read(key, (layer, 0), (1, width))[0], hf[p + hf_name]), key
    emb = reader.read("embedding.word_embeddings.weight")
    assert emb.shape == (512, 64)  # vocab 300 padded to a multiple of 128 * tp
    assert torch.equal(emb[:300], hf["model.embed_tokens.weight"]) and not emb[300:].any()
    assert reader.read("output_layer.weight").shape == (512, 64)
    files = sorted(p.name for p in (tmp_path / "mcore").iterdir())
    assert files == [".metadata", "__0_0.distcp", "common.pt", "hf", "metadata.json"]
    assert json.loads((tmp_path / "mcore" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"


def test_sharded_input_and_output_with_index(tmp_path: Path) -> None:
    model = make_model("qwen2", seed=3)
    src = save_model(model, tmp_path / "hf", max_shard_size="60KB")
    assert (src / "model.safetensors.index.json").exists()
    convert_hf_to_mcore(src, tmp_path / "mcore", progress=False)
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", max_shard_bytes=50_000, progress=False)
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "back").glob("*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    assert not list((tmp_path / "back").glob(".shard-*"))
    want, got = read_all(src), read_all(tmp_path / "back")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())


def test_dtype_option_casts(tmp_path: Path) -> None:
    src = save_model(make_model("llama", seed=4), tmp_path / "hf")
    convert_hf_to_mcore(src, tmp_path / "mcore", dtype="bf16", progress=False)
    assert CheckpointReader(tmp_path / "mcore").read("decoder.final_layernorm.weight").dtype == torch.bfloat16
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    want, got = read_all(src), read_all(tmp_path / "back")
    for k in want:
        assert torch.equal(got[k], want[k].to(torch.bfloat16)), k
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back32", dtype="fp32", progress=False)
    assert read_all(tmp_path / "back32")["lm_head.weight"].dtype == torch.float32


def test_config_from_explicit_hf_config_dir(tmp_path: Path) -> None:
    """The checkpoint's own copy of the config is removed; --hf-config supplies it."""
    import shutil

    src = save_model(make_model("llama_tied", seed=5), tmp_path / "hf")
    convert_hf_to_mcore(src, tmp_path / "mcore", progress=False)
    shutil.rmtree(tmp_path / "mcore" / "hf")
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", hf_config=src, progress=False)
    assert (tmp_path / "back" / "tokenizer_config.json").exists()
    want, got = read_all(src), read_all(tmp_path / "back")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_value_model_round_trip(tmp_path: Path) -> None:
    """A scalar-head model (HF *ForSequenceClassification, num_labels=1) converts as the value role."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForSequenceClassification(config).eval()
    src = save_model(model, tmp_path / "hf")
    convert_hf_to_mcore(src, tmp_path / "mcore", tp=2, progress=False)
    reader = CheckpointReader(tmp_path / "mcore")
    assert reader.common()["megarl"]["role"] == "value"
    assert torch.equal(reader.read("output_layer.weight"), model.score.weight.detach())
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    want, got = read_all(src), read_all(tmp_path / "back")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]


def test_trainer_step_directory_is_refused_with_a_hint(tmp_path: Path) -> None:
    from megarl.errors import CheckpointError

    src = save_model(make_model("llama", seed=0), tmp_path / "hf")
    step = tmp_path / "run" / "checkpoints" / "global_step_3"
    convert_hf_to_mcore(src, step / "actor", progress=False)
    with pytest.raises(CheckpointError, match="trainer step directory: pass one of .*actor"):
        convert_mcore_to_hf(step, tmp_path / "back", progress=False)
