"""Tiny random HF causal LMs of every supported family, saved as safetensors (the HF side of tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# GQA everywhere (4 query heads, 2 key/value groups); vocab 300 pads to 384 at TP=1, 512 at TP=2.
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", dict(tie_word_embeddings=False)),
    "llama_tied": ("Llama", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2", dict(tie_word_embeddings=False)),  # q/k/v biases
    "qwen2_tied": ("Qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3", dict(tie_word_embeddings=False, head_dim=16)),  # QK-norm
    "mistral": ("Mistral", dict(tie_word_embeddings=False, sliding_window=None)),
    # Mixture of experts: 4 experts of width 32 (stored one by one in the checkpoint).
    "qwen3_moe": ("Qwen3Moe", dict(tie_word_embeddings=False, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2Moe", dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=32, shared_expert_intermediate_size=48)),
}


def make_model(kind: str, seed: int = 0, layers: int = 2, vocab: int = 300) -> torch.nn.Module:
    import transformers

    prefix, extra = KINDS[kind]
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a misplaced tensor shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save_model(model: torch.nn.Module, path: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')  # stands for tokenizer files
    return path


def read_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF directory (single file or sharded)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out
