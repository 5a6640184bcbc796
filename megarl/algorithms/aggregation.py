"""Loss aggregation (token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm).

The gradient of a mini-batch must not depend on how it is cut into micro-batches and data-parallel
(DP) ranks. A mean taken per micro-batch breaks that as soon as micro-batches hold different numbers
of tokens or sequences, so the normalisers are computed once for the whole mini-batch
(``mini_batch_normalisers``) and passed to every micro-batch's ``agg_loss``.

Convention, with the normalisers of the whole mini-batch passed in:

* each micro-batch's loss is its *share*: the sum of its terms divided by the global normaliser,
  times ``dp_size``;
* on one rank, micro-batch gradients are *summed* (call ``backward`` on each; do not divide by the
  number of micro-batches);
* across DP ranks, gradients are *averaged* (what DDP's all-reduce does, dividing by ``dp_size``,
  which the factor ``dp_size`` above undoes).

The result is exactly the gradient of the mini-batch loss computed in one piece. The same sum of the
returned values over all micro-batches and ranks, divided by ``dp_size``, is the mini-batch loss.
Without normalisers, the given tensor is treated as the whole mini-batch.

Modes, for a mini-batch with N valid tokens, S sequences holding at least one valid token, and a
constant length L (``max_response_len``):

* ``token-mean``: sum of all valid terms / N
* ``seq-mean-token-sum``: sum over sequences of (sum of the sequence's terms) / S
* ``seq-mean-token-mean``: sum over sequences of (mean of the sequence's terms) / S
* ``seq-mean-token-sum-norm`` (Dr.GRPO): sum of all valid terms / (S * L). verl divides by L only
  (its scale then depends on the batch size); we keep the sequence mean the name promises.

Sequences without any valid token (e.g. padding rows) count in no normaliser. An empty mini-batch
gives loss 0 (normalisers are clamped to at least 1), with zero gradient.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch

from megarl.errors import ConfigError

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossNormalisers:
    """Global normalisers of one mini-batch: counted over all its micro-batches on all DP ranks.

    Pass to ``aggregate`` or to a policy/value loss's ``normalisers=``. Counts from DP ranks'
    shards add up (all-reduce-sum the two counts).
    """

    global_num_tokens: float  # valid tokens
    global_num_seqs: float  # sequences with at least one valid token
    max_response_len: int  # L of seq-mean-token-sum-norm; keep it constant across steps
    dp_size: int = 1  # data-parallel ranks whose gradients DDP averages


def mini_batch_normalisers(
    response_mask: torch.Tensor, *, max_response_len: Optional[int] = None, dp_size: int = 1
) -> LossNormalisers:
    """Normalisers of the mini-batch whose (B, R) mask is given (before it is split).

    ``max_response_len`` defaults to R; pass the configured response length so that
    ``seq-mean-token-sum-norm`` uses the same constant in every step.
    """
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask: expected (batch, response_len), got {tuple(response_mask.shape)}")
    if dp_size < 1:
        raise ConfigError(f"dp_size = {dp_size}: must be >= 1")
    mask = response_mask.bool()
    return LossNormalisers(
        global_num_tokens=float(mask.sum()),
        global_num_seqs=float(mask.any(dim=-1).sum()),
        max_response_len=int(max_response_len if max_response_len is not None else mask.shape[-1]),
        dp_size=dp_size,
    )


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    max_response_len: Optional[int] = None,
    dp_size: int = 1,
) -> torch.Tensor:
    """Aggregate a (B, R) per-token loss into a scalar (see the module docstring for the convention).

    ``global_num_tokens`` is needed by ``token-mean``, ``global_num_seqs`` by the ``seq-mean-*``
    modes; without either, this (B, R) tensor is the whole mini-batch. Terms where ``mask`` is 0
    are ignored, even if NaN.
    """
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(f"loss_agg_mode = {mode!r}: unknown; valid: {list(LOSS_AGG_MODES)}")
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"agg_loss: loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must both be "
            "(batch, response_len)"
        )
    valid = mask.bool()
    is_global = global_num_tokens is not None or global_num_seqs is not None
    if not is_global and dp_size != 1:
        raise ValueError("agg_loss: dp_size > 1 needs the global normalisers of the mini-batch")
    zero = loss_mat.new_zeros(())
    token_sums = torch.where(valid, loss_mat, zero).sum(dim=-1)  # (B,)

    if mode == "token-mean":
        if is_global and global_num_tokens is None:
            raise ValueError("agg_loss: token-mean needs global_num_tokens")
        denom = float(global_num_tokens) if is_global else float(valid.sum())
        total = token_sums.sum()
    else:
        if is_global and global_num_seqs is None:
            raise ValueError(f"agg_loss: {mode} needs global_num_seqs")
        denom = float(global_num_seqs) if is_global else float(valid.any(dim=-1).sum())
        if mode == "seq-mean-token-mean":
            tokens_per_seq = valid.sum(dim=-1).clamp_min(1).to(loss_mat.dtype)
            total = (token_sums / tokens_per_seq).sum()
        else:
            total = token_sums.sum()
            if mode == "seq-mean-token-sum-norm":
                denom *= float(max_response_len if max_response_len is not None else mask.shape[-1])
    return total / max(denom, 1.0) * dp_size


def aggregate(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, normalisers: Optional[LossNormalisers] = None
) -> torch.Tensor:
    """``agg_loss`` with the mini-batch's normalisers, if given (else this batch is the mini-batch)."""
    return agg_loss(loss_mat, mask, mode, **(asdict(normalisers) if normalisers is not None else {}))
