"""Tiny HF models, batches and plain-PyTorch references shared by the engine tests.

Everything here is independent of the engine under test: references are HF transformers forward
passes in float64 and a hand-written AdamW step on the HF model. Megatron is imported inside the
functions that run in the rank processes, so that pytest's own process does not load it.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist

VOCAB = 200

# Budget for comparing two float32 computations of one gradient (another micro-batch split, layout,
# sequence parallelism, recompute) with each other or with the float64 reference, as a relative L2
# error over the whole model (`relative_error`). Why it holds on any CPU: each entry is a chain of
# float32 sums whose order the kernels choose (blocking, threads, vector width). A sum of n terms errs
# by at most n*u times the sum of magnitudes (u = 2^-24 = 6e-8), and by about sqrt(n)*u when
# rounding errors have random signs (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019). The longest
# sums in these tiny models have n <= ~10^3 (hidden 64, MLP 96, vocab 200, < 100 tokens per weight
# gradient): sqrt(n)*u ~ 2e-6 per reduction, and the ~10 reductions chained through forward and
# backward add in quadrature to ~6e-6. Measured: 1-3e-7 between splits and against float64. Relative
# to the whole gradient's norm, unlike entry by entry, the measure does not blow up on entries that
# cancel to nearly zero. The faults these tests look for (a micro-batch lost or counted twice, a
# wrong loss, DP, CP or TP scale) change the gradient by 1e-1 or more.
GRAD_RTOL = 2e-5


def adam_weight_atol(lr: float, eps: float, grad_norm: float, clip_grad: float) -> float:
    """Largest weight difference after one of the first three Adam steps (betas 0.9, 0.999) when the
    step's gradient differs by GRAD_RTOL (relative L2) and earlier steps were identical.

    Clipping to `clip_grad` maps the gradient difference to at most GRAD_RTOL * min(|g|, clip_grad).
    The update lr * m_hat / (sqrt(v_hat) + eps) changes by at most lr/eps per unit change of the
    step's gradient g: at step 1 it is lr * g / (|g| + eps), slope lr * eps / (|g| + eps)^2; at step
    t the slope is at most lr * (w_t / eps + sqrt(z_t) * C_t * sqrt(v_hat) / (sqrt(v_hat) + eps)^2)
    <= lr/eps * (w_t + sqrt(z_t) * C_t / 4), with w_t = (1-b1)/(1-b1^t), z_t = (1-b2)/(1-b2^t) and
    C_t >= |m_hat|/sqrt(v_hat) (Cauchy-Schwarz on the bias-corrected averages: 1.0014 at t=2,
    1.0036 at t=3): 0.70 lr/eps at step 2, 0.51 lr/eps at step 3.
    With eps << lr (1e-6 against 1e-3) a rounding difference in a near-zero gradient moves a weight
    by up to lr: compare gradients there, not weights."""
    return lr / eps * GRAD_RTOL * min(grad_norm, clip_grad)

HF_CONFIGS: dict[str, dict[str, Any]] = {
    # GQA: 4 query heads, 2 key/value groups.
    "llama": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "llama_tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    # Llama 3.x RoPE scaling with a short original context (16), so that it changes every frequency
    # at the tests' positions (wavelengths 6.3 (interpolated), 19.9 and longer (divided by 4)) and
    # its constants differ from the ones Megatron-Core's own rope_scaling fixes (1, 4, 8192).
    "llama_rope": dict(num_key_value_heads=2, tie_word_embeddings=False,
                       rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=3.0,
                                         original_max_position_embeddings=16)),
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


def make_moe_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A random tiny HF MoE causal LM: 4 experts of width 32, top-2, hidden 64, 4 heads (GQA 2)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  tie_word_embeddings=False)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, head_dim=16, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**common, shared_expert_intermediate_size=48, norm_topk_prob=False)
        cls = transformers.Qwen2MoeForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    # The plain per-expert loop: the grouped-GEMM kernel has no float64 (the reference runs in it).
    model.set_experts_implementation("eager")
    with torch.no_grad():  # non-trivial norms, biases and a router that prefers different experts
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
    return model


def with_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of `model` holding `state` (e.g. reference weights or gradients under the in-memory
    names; `save_hf_model` then writes them under the checkpoint's names, experts one by one)."""
    import copy

    out = copy.deepcopy(model)
    out.load_state_dict(state)
    return out


_SCRATCH_DIRS: list[str] = []


def _remove_scratch_dirs() -> None:
    for path in _SCRATCH_DIRS:
        shutil.rmtree(path, ignore_errors=True)


def scratch_dir(prefix: str) -> str:
    """A temporary folder removed when this process exits. Called in test bodies (the pytest
    process), whose ranks are done with the folder by then."""
    if not _SCRATCH_DIRS:
        atexit.register(_remove_scratch_dirs)
    _SCRATCH_DIRS.append(tempfile.mkdtemp(prefix=prefix))
    return _SCRATCH_DIRS[-1]


def save_hf_model(model: torch.nn.Module) -> str:
    path = scratch_dir("megarl_hf_")
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_weight_names(hf_dir: str) -> list[str]:
    """The tensor names of a directory written by `save_hf_model`."""
    from safetensors import safe_open

    with safe_open(f"{hf_dir}/model.safetensors", framework="pt") as f:
        return list(f.keys())


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


def _float64_backward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A float64 copy of the HF model after backward of `pg_loss_fn`'s loss over the whole batch."""
    import copy

    ref = copy.deepcopy(model).double().train()
    lp, ent = hf_logprobs_with_grad(ref, batch)
    mask = batch["response_mask"].double()
    n = mask.sum()
    loss = (-(lp * batch["advantages"].double() * mask).sum() - ENTROPY_COEF * (ent * mask).sum()) / n
    loss.backward()
    return ref


def reference_gradients(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float64 gradient of `pg_loss_fn`'s loss over the whole batch, by HF parameter name."""
    ref = _float64_backward(model, batch)
    return {name: p.grad.detach().clone() for name, p in ref.named_parameters() if p.grad is not None}


def reference_train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], lr: float, eps: float,
                         clip_grad: float, betas: tuple[float, float] = (0.9, 0.999)) -> tuple[dict[str, torch.Tensor], float]:
    """One AdamW step (no weight decay) of the same loss on the HF model in float64, written out by
    hand. Returns (new HF state dict in float32, grad norm before clipping)."""
    ref = _float64_backward(model, batch)
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
    return _gather_hf({n: t.detach().float().cpu().clone() for n, t in engine.get_named_weights()}, engine)


def gather_hf_grads(engine: Any) -> dict[str, torch.Tensor]:
    """The gradient of the engine's last optimizer step, by HF name (every rank returns it).

    Megatron DDP accumulates each parameter's gradient in its fp32 `main_grad` buffer; after
    `train_step` that buffer holds the DP-reduced (and TP/SP-finalised) gradient until the next
    step zeroes it. Pass clip_grad large enough not to clip: clipping scales the buffer in place.
    The distributed optimizer shards the reduced gradient over the DP x CP ranks, so this needs
    dp = cp = 1 or use_distributed_optimizer=False."""
    from megarl.megatron.model import unwrap

    if engine.ranks.dp_size * engine.ranks.cp_size > 1 and engine.cfg.use_distributed_optimizer:
        raise ValueError("gather_hf_grads: the distributed optimizer shards the gradient over DP x CP ranks; "
                         "build the engine with use_distributed_optimizer=False")
    grads = {n: p.main_grad.detach().float().cpu().clone() for n, p in unwrap(engine.ddp).named_parameters()}
    return _gather_hf(grads, engine)


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """||got - want|| / ||want|| over all tensors together (L2, in float64); same keys required."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    diff = sum(float(((got[k].double() - want[k].double()) ** 2).sum()) for k in want)
    norm = sum(float((want[k].double() ** 2).sum()) for k in want)
    return (diff / norm) ** 0.5


def _gather_hf(local: dict[str, torch.Tensor], engine: Any) -> dict[str, torch.Tensor]:
    """Every rank's {Megatron name: local shard} -> one HF state dict (every rank returns it)."""
    from megatron.core import parallel_state as ps

    from megarl.models.weight_map import megatron_to_hf_state_dict

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
