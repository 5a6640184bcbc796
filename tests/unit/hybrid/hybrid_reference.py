"""Independent references for the reshard tests: a tiny Qwen2-like spec, an HF state dict whose
every element is a unique id (so a misplaced element cannot go unnoticed), the training shards of
every rank, and the expected rollout shards written out by hand from the HF tensors."""

from __future__ import annotations

import math
from typing import Any

import torch

VOCAB = 150  # Megatron pads to 128 * tp, vLLM to a multiple of 64: the paddings differ
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 32, 4, 2, 8, 48


def tiny_config(tied: bool, layers: int = 2, family: str = "qwen2") -> dict[str, Any]:
    return dict(
        model_type=family, architectures=["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"],
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, hidden_act="silu",
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=tied,
    )


def hf_shapes(tied: bool, layers: int = 2) -> dict[str, tuple[int, ...]]:
    """HF Qwen2 parameter shapes, written out (q/k/v biases; lm_head only when untied)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.q_proj.bias": (HEADS * HEAD_DIM,),
            p + "self_attn.k_proj.bias": (KV_HEADS * HEAD_DIM,),
            p + "self_attn.v_proj.bias": (KV_HEADS * HEAD_DIM,),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN),
            p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
        })
    return shapes


def id_state_dict(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """float64 tensors whose elements are 1, 2, 3, ... across all tensors (0 never appears)."""
    out, next_id = {}, 1
    for name in sorted(shapes):
        n = math.prod(shapes[name])
        out[name] = torch.arange(next_id, next_id + n, dtype=torch.float64).reshape(shapes[name])
        next_id += n
    return out


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def expected_vllm_shard(hf: dict[str, torch.Tensor], r: int, tp: int, layers: int, tied: bool) -> dict[str, torch.Tensor]:
    """vLLM's parameters on rollout TP rank r, built by hand: qkv_proj = [q_r | k_r | v_r],
    gate_up_proj = [gate_r | up_r], vocabulary padded to a multiple of 64 and split in rows,
    o_proj / down_proj split in columns, norms whole."""
    def rows(t: torch.Tensor, n: int, i: int) -> torch.Tensor:
        return t[i * n:(i + 1) * n]

    padded = -(-VOCAB // 64) * 64
    out = {"model.embed_tokens.weight": rows(_pad_rows(hf["model.embed_tokens.weight"], padded), padded // tp, r),
           "model.norm.weight": hf["model.norm.weight"]}
    if not tied:
        out["lm_head.weight"] = rows(_pad_rows(hf["lm_head.weight"], padded), padded // tp, r)
    q_rows = HEADS // tp * HEAD_DIM
    if KV_HEADS >= tp:
        kv_rows, kv_index = KV_HEADS // tp * HEAD_DIM, r
    else:
        kv_rows, kv_index = HEAD_DIM, r // (tp // KV_HEADS)
    for i in range(layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = (hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
            out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat([rows(q, q_rows, r), rows(k, kv_rows, kv_index),
                                                              rows(v, kv_rows, kv_index)])
        out[p + "self_attn.o_proj.weight"] = hf[p + "self_attn.o_proj.weight"][:, r * q_rows:(r + 1) * q_rows]
        f = FFN // tp
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([rows(hf[p + "mlp.gate_proj.weight"], f, r),
                                                        rows(hf[p + "mlp.up_proj.weight"], f, r)])
        out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"][:, r * f:(r + 1) * f]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{norm}.weight"] = hf[f"{p}{norm}.weight"]
    return out
