"""Entropy of the policy's token distribution, from logits."""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of ``softmax(logits)`` over the last dim: (..., V) -> (...).

    Computed as ``logsumexp(z) - sum(softmax(z) * z)`` on logits shifted by their maximum: nothing
    large is exponentiated, and the two terms stay small, so large logits lose no precision to
    cancellation. ``-inf`` logits (banned tokens) contribute 0 to value and gradient; NaN stays NaN.
    """
    top = logits.detach().amax(dim=-1, keepdim=True)
    shifted = (logits - top).clamp(min=torch.finfo(logits.dtype).min)  # -inf -> lowest float
    probs = torch.softmax(shifted, dim=-1)
    return torch.logsumexp(shifted, dim=-1) - (probs * shifted).sum(dim=-1)
