"""Critic loss with value clipping (PPO)."""

from __future__ import annotations

from typing import Optional

import torch

from megarl.algorithms.aggregation import LossNormalisers, aggregate
from megarl.algorithms.utils import masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    normalisers: Optional[LossNormalisers] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))``, all inputs (B, R).

    ``vpreds``: the critic's current predictions (with gradient); ``values``: the predictions made
    when the batch was collected; ``returns``: the targets (e.g. GAE returns). Metrics (floats over
    this micro-batch): ``vf_clipfrac`` (share of tokens where the clipped term is larger) and
    ``vpred_mean``.
    """
    clipped_pred = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_loss = (vpreds - returns).square()
    clipped_loss = (clipped_pred - returns).square()
    losses = torch.maximum(unclipped_loss, clipped_loss)
    loss = 0.5 * aggregate(losses, response_mask, loss_agg_mode, normalisers)
    metrics = {
        "vf_clipfrac": float(masked_mean((clipped_loss > unclipped_loss).to(torch.float32), response_mask)),
        "vpred_mean": float(masked_mean(vpreds.detach(), response_mask)),
    }
    return loss, metrics
