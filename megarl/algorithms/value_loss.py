"""Critic loss with value clipping (PPO).

Like the policy losses, it takes the micro-batch's tensors as one ``ValueLossInputs`` and the
critic's constants as one ``ValueLossSettings``::

    loss, metrics = compute_value_loss(ValueLossInputs(vpreds, returns, values, response_mask,
                                                       normalisers=normalisers),
                                       ValueLossSettings(cliprange_value=0.5, loss_agg_mode="token-mean"))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megarl.algorithms.aggregation import LossNormalisers, aggregate
from megarl.algorithms.utils import masked_mean


@dataclass(frozen=True, eq=False)
class ValueLossInputs:
    """One micro-batch's tensors, all (B, R): B responses of R tokens."""

    vpreds: torch.Tensor  # the critic's current predictions, with gradient
    returns: torch.Tensor  # the targets (e.g. GAE returns)
    values: torch.Tensor  # the predictions made when the batch was collected
    response_mask: torch.Tensor  # 0/1: 1 on the generated tokens that count in the loss
    normalisers: Optional[LossNormalisers] = None  # of the whole mini-batch; None: this is the mini-batch


@dataclass(frozen=True)
class ValueLossSettings:
    """The critic's constants (from ``critic.*`` of the experiment config)."""

    cliprange_value: float  # predictions kept within +-cliprange_value of ``values``
    loss_agg_mode: str = "token-mean"  # one of aggregation.LOSS_AGG_MODES


def compute_value_loss(inputs: ValueLossInputs, settings: ValueLossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """``0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))``, all inputs (B, R).

    ``v`` = ``inputs.vpreds``, ``v_old`` = ``inputs.values``, ``R`` = ``inputs.returns``,
    ``c`` = ``settings.cliprange_value``. Metrics (floats over this micro-batch): ``vf_clipfrac``
    (share of tokens where the clipped term is larger) and ``vpred_mean``.
    """
    vpreds, returns, values, response_mask = inputs.vpreds, inputs.returns, inputs.values, inputs.response_mask
    clip = settings.cliprange_value
    clipped_pred = torch.clamp(vpreds, values - clip, values + clip)
    unclipped_loss = (vpreds - returns).square()
    clipped_loss = (clipped_pred - returns).square()
    losses = torch.maximum(unclipped_loss, clipped_loss)
    loss = 0.5 * aggregate(losses, response_mask, settings.loss_agg_mode, inputs.normalisers)
    metrics = {
        "vf_clipfrac": float(masked_mean((clipped_loss > unclipped_loss).to(torch.float32), response_mask)),
        "vpred_mean": float(masked_mean(vpreds.detach(), response_mask)),
    }
    return loss, metrics
