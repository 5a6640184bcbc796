"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. Max, sum-exp, the
target logit and the expected logit are reduced over the TP group; nothing of size V crosses ranks.
Differentiable: the reductions go through Megatron's `reduce_from_tensor_model_parallel_region`
(all-reduce forward, identity backward), which is the gradient of a sum that every rank replicates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Padded vocabulary columns (beyond the tokenizer's vocab) get this logit: exp() of it is exactly 0
# in fp32, and 0 * it stays finite in the entropy sum.
_PAD_LOGIT = -1.0e30


def _tp_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(target) and entropy.

    logits: (..., V_local) this rank's slice, columns [vocab_start, vocab_start + V_local) of the
    padded vocabulary; columns >= `vocab_size` (padding) are excluded. targets: (...) int64 token ids.
    temperature: logits are divided by it first (as the rollout sampled).
    Returns (log_probs (...), entropy (...) or None), float32.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    local_vocab = logits.shape[-1]
    if vocab_start + local_vocab > vocab_size:
        col = torch.arange(vocab_start, vocab_start + local_vocab, device=logits.device)
        logits = logits.masked_fill(col >= vocab_size, _PAD_LOGIT)

    # Max is only a stabiliser: no gradient needed through it.
    local_max = logits.detach().max(dim=-1).values
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - local_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _tp_sum(exp.sum(dim=-1), tp_group)
    log_z = sum_exp.log()

    local_idx = targets - vocab_start
    owned = (local_idx >= 0) & (local_idx < local_vocab)
    picked = shifted.gather(-1, local_idx.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _tp_sum(torch.where(owned, picked, torch.zeros_like(picked)), tp_group)
    log_probs = target_logit - log_z

    entropy = None
    if with_entropy:
        # H = log Z - E_p[shifted logit]
        expected = _tp_sum((exp * shifted).sum(dim=-1), tp_group) / sum_exp
        entropy = log_z - expected
    return log_probs, entropy
