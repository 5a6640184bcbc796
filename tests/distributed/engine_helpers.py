"""Tiny HF models, batches and plain-PyTorch references shared by the engine tests.

Everything here is independent of the engine under test: references are HF transformers forward
passes in float64 and a hand-written AdamW step on the HF model.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist

VOCAB = 200

HF_CONFIGS: dict[str, dict[str, Any]] = {
    # GQA: 4 query heads, 2 key/value groups.
    "llama": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "llama_tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2": dict(num_key_value_heads=2, tie_word_embeddings=False),  # q/k/v biases
    "qwen3": dict(num_key_value_heads=2, tie_word_embeddings=False, head_dim=16),  # QK-norm
    "mistral": dict(num_key_value_heads=2, tie_word_embeddings=False, sliding_window=64),
}


def make_hf_model(kind: str, seed: int = 0, num_layers: int = 2) -> torch.nn.Module:
    """A random tiny HF causal LM (hidden 64, 4 heads of 16, vocab 200) in float32."""
    import transformers

    family = kind.split("_")[0]
    cls_prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
    config_cls = getattr(transformers, f"{cls_prefix}Config")
    model_cls = getattr(transformers, f"{cls_prefix}ForCausalLM")
    config = config_cls(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6, **HF_CONFIGS[kind],
    )
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():  # random non-trivial norm weights and biases, so that mapping errors show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save_hf_model(model: torch.nn.Module) -> str:
    path = tempfile.mkdtemp(prefix="megarl_hf_")
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_batch(seed: int, batch: int = 4, prompt_len: int = 6, response_len: int = 5) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of varied lengths (verl's columns)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB, (batch, prompt_len), generator=g)
    responses = torch.randint(0, VOCAB, (batch, response_len), generator=g)
    mask = torch.ones(batch, prompt_len + response_len, dtype=torch.long)
    for i in range(batch):
        pad_left = int(torch.randint(0, prompt_len - 1, (1,), generator=g))
        resp_valid = int(torch.randint(1, response_len + 1, (1,), generator=g))
        mask[i, :pad_left] = 0
        mask[i, prompt_len + resp_valid:] = 0
    prompts = torch.where(mask[:, :prompt_len].bool(), prompts, torch.zeros_like(prompts))
    responses = torch.where(mask[:, prompt_len:].bool(), responses, torch.zeros_like(responses))
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": mask[:, prompt_len:].float(),
        "advantages": torch.randn(batch, response_len, generator=g),
    }


def hf_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0,
                dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_probs, entropy) (B, R) of the response tokens from the HF model (no grad)."""
    import copy

    ref = copy.deepcopy(model).to(dtype)
    with torch.no_grad():
        lp, ent = hf_logprobs_with_grad(ref, batch, temperature)
    return lp.detach(), ent.detach()


def hf_logprobs_with_grad(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits
    logp = torch.log_softmax(logits[:, p - 1:p + r - 1] / temperature, dim=-1)
    lp = logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


ENTROPY_COEF = 0.01


def pg_loss_fn(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor], n: Any) -> tuple[torch.Tensor, dict]:
    """Policy-gradient loss with an entropy bonus, token-mean over the whole mini-batch (the
    algorithm library's aggregation), so micro-batch and DP splits must not change the gradient."""
    from dataclasses import asdict

    from megarl.algorithms.aggregation import agg_loss

    mask = mb["response_mask"]
    pg = agg_loss(-outputs["log_probs"] * mb["advantages"], mask, "token-mean", **asdict(n))
    ent = agg_loss(outputs["entropys"], mask, "token-mean", **asdict(n))
    return pg - ENTROPY_COEF * ent, {"pg": pg.detach()}


def reference_train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], lr: float, eps: float,
                         clip_grad: float, betas: tuple[float, float] = (0.9, 0.999)) -> tuple[dict[str, torch.Tensor], float]:
    """One AdamW step (no weight decay) of the same loss on the HF model in float64, written out by
    hand. Returns (new HF state dict in float32, grad norm before clipping)."""
    import copy

    ref = copy.deepcopy(model).double().train()
    lp, ent = hf_logprobs_with_grad(ref, batch)
    mask = batch["response_mask"].double()
    n = mask.sum()
    loss = (-(lp * batch["advantages"].double() * mask).sum() - ENTROPY_COEF * (ent * mask).sum()) / n
    loss.backward()
    params = [p for p in ref.parameters() if p.grad is not None]
    norm = float(torch.sqrt(sum((p.grad**2).sum() for p in params)))
    scale = min(1.0, clip_grad / (norm + 1e-6))
    with torch.no_grad():
        for p in params:
            g = p.grad * scale
            m = (1 - betas[0]) * g / (1 - betas[0])  # bias-corrected first moment after one step
            v = (1 - betas[1]) * g * g / (1 - betas[1])
            p -= lr * m / (v.sqrt() + eps)
    return {k: v.float() for k, v in ref.state_dict().items()}, norm


def gather_hf_state(engine: Any) -> dict[str, torch.Tensor]:
    """All ranks' shards -> one HF state dict (every rank returns it)."""
    from megatron.core import parallel_state as ps

    from megarl.models.weight_map import megatron_to_hf_state_dict

    local = {n: t.detach().float().cpu().clone() for n, t in engine.get_named_weights()}
    mine = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank(), local)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    shards: list[list[Any]] = [[None] * tp for _ in range(pp)]
    for p, t, d, sd in everyone:
        if d == 0:
            shards[p][t] = sd
    return megatron_to_hf_state_dict(shards, engine.spec.for_role(engine.role), te_names=engine.use_te)
