"""Masked statistics, per-group statistics and input checks shared by the algorithm modules.

Everything here is vectorised: per-group statistics use ``index_add_``/``scatter_reduce`` over a
compact group id, never a Python loop over samples. Masks may be bool, int or float (0/1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from megarl.errors import DataError

WHITEN_EPS = 1e-8  # verl: (x - mean) * rsqrt(var + 1e-8)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is non-zero; values outside the mask (even NaN) are ignored."""
    picked = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``values`` over the mask; 0 where the mask is empty (instead of NaN)."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp_min(1).to(values.dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with mean and unbiased variance over the mask (verl's).

    ``values`` (..., R) finite (the estimators check their inputs, so the mask can be applied by
    multiplication: this sits on the hot path of large batches, where ``torch.where`` is slow).
    Returns a tensor of the same shape (``values`` itself if ``inplace``), 0 outside the mask. With
    fewer than two valid elements the variance is taken as 0 (verl raises).
    """
    m = mask.to(values.dtype)
    count = float(m.sum())
    centred = values.mul_(m) if inplace else values * m
    if count == 0:
        return centred
    mean = float(centred.sum()) / count
    centred.sub_(m, alpha=mean)
    # Per-row norms keep float32 accumulation errors small (one long dot product would not).
    row_norms = torch.linalg.vector_norm(centred.reshape(-1, centred.shape[-1]), dim=-1)
    var = float(row_norms.double().square().sum()) / (count - 1) if count > 1 else 0.0
    return centred.mul_(1.0 / float(np.sqrt(var + WHITEN_EPS)))


# ----------------------------------------------------------------------------------------------
# Groups (the responses sampled for one prompt)


def group_index_from_uids(uids: Sequence[object] | np.ndarray) -> torch.Tensor:
    """(B,) int64 group ids from per-sample prompt uids (equal uid -> equal id; ids are 0..G-1)."""
    arr = np.asarray(uids)
    if arr.ndim != 1:
        raise DataError(f"uid: expected a 1-D array of per-sample prompt ids, got shape {arr.shape}")
    _, inverse = np.unique(arr, return_inverse=True)
    return torch.from_numpy(inverse.astype(np.int64).reshape(-1))


def compact_groups(group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Map arbitrary integer group ids to 0..G-1. Returns ``(inverse (B,), sizes (G,))``."""
    _, inverse, sizes = torch.unique(group_index, return_inverse=True, return_counts=True)
    return inverse, sizes


def group_sum(values: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(G,) per-group sums of per-sample ``values`` (B,)."""
    out = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return out.index_add_(0, inverse, values)


def group_mean_std(
    scores: torch.Tensor, inverse: torch.Tensor, sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group mean and unbiased std (G,) of ``scores`` (B,), two-pass for accuracy.

    The std of a singleton group is NaN-free 0 here; callers apply their own singleton convention.
    """
    n = sizes.to(scores.dtype)
    mean = group_sum(scores, inverse, len(sizes)) / n
    sq_dev = group_sum((scores - mean[inverse]).square(), inverse, len(sizes))
    std = (sq_dev / (n - 1).clamp_min(1)).sqrt()
    return mean, std


# ----------------------------------------------------------------------------------------------
# Input checks (the boundary between rollout/reward code and the math)


REWARD_HINT = "Rewards must be finite numbers; check the reward function for these samples."


def _sample_label(i: int, uids: Optional[Sequence[object] | np.ndarray]) -> str:
    return f"sample {i} (uid {uids[i]!r})" if uids is not None else f"sample {i}"


def check_finite(name: str, tensor: torch.Tensor, uids: Optional[Sequence[object] | np.ndarray] = None, *,
                 hint: str = "") -> None:
    """Raise DataError naming the first samples (rows) whose ``tensor`` holds NaN or inf.

    ``hint`` ends the message: where this tensor's values come from, so that the user looks there
    (`REWARD_HINT` for rewards, the critic for values, the model's forward pass for log-probs). Empty
    by default: a wrong guess (the reward function for a critic's NaN) sends the user to the wrong code.
    """
    if tensor.numel() == 0:
        return
    rows = tensor.reshape(tensor.shape[0], -1)
    if bool(torch.isfinite(rows.sum(dim=-1)).all()):  # a NaN/inf anywhere makes its row sum non-finite
        return
    bad_rows = (~torch.isfinite(rows)).any(dim=1).nonzero().flatten().tolist()
    if not bad_rows:  # finite values whose sum overflowed
        return
    shown = []
    for i in bad_rows[:5]:
        pos = int((~torch.isfinite(rows[i])).nonzero()[0])
        where = f" at position {pos}" if tensor.dim() > 1 else ""
        shown.append(f"{_sample_label(i, uids)}: {float(rows[i, pos])}{where}")
    more = f" and {len(bad_rows) - 5} more" if len(bad_rows) > 5 else ""
    raise DataError(
        f"{name}: non-finite values in {len(bad_rows)} sample(s): " + "; ".join(shown) + more
        + (f". {hint}" if hint else "")
    )


def check_response_tensors(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Shapes of the (B, R) inputs every advantage estimator takes."""
    if token_level_rewards.dim() != 2:
        raise DataError(
            f"token_level_rewards: expected shape (batch, response_len), got {tuple(token_level_rewards.shape)}"
        )
    if response_mask.shape != token_level_rewards.shape:
        raise DataError(
            f"response_mask: shape {tuple(response_mask.shape)} differs from token_level_rewards "
            f"{tuple(token_level_rewards.shape)}"
        )
    if not token_level_rewards.is_floating_point():
        raise DataError(f"token_level_rewards: expected a float tensor, got {token_level_rewards.dtype}")


def check_group_index(group_index: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The (B,) integer group ids a group-based estimator needs: DataError on another dtype or shape."""
    if group_index.shape != (batch_size,) or group_index.is_floating_point() or group_index.dtype == torch.bool:
        raise DataError(
            f"group_index: expected an integer tensor of shape ({batch_size},), got {group_index.dtype} "
            f"{tuple(group_index.shape)}"
        )
    return group_index
