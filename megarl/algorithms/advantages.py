"""Advantage estimators: GAE, GRPO (and Dr.GRPO), RLOO, REINFORCE++ (+baseline), ReMax, GRPO pass@k.

Every estimator takes the batch's tensors as one ``AdvantageInputs`` and the algorithm's constants as
one ``AdvantageSettings``, so the trainer can call any of them by name::

    inputs = AdvantageInputs(token_level_rewards, response_mask, group_index=..., values=..., uids=...)
    settings = AdvantageSettings(gamma=1.0, lam=1.0, norm_adv_by_std=True, pass_k=None)
    advantages, returns = get_advantage_estimator(name)(inputs, settings)

Both outputs are (B, R), in the dtype of ``token_level_rewards``, and 0 wherever the mask is 0.
The optional fields are filled with what the batch has; an estimator takes the ones it needs with
``inputs.require(field, estimator)``, which raises a DataError naming the estimator, the field and
how to provide it when the field is None. A user estimator registered with
``register_advantage_estimator(name)`` takes the same two arguments. Loops run over time steps
(GAE, REINFORCE++), never over samples.

Conventions (verl's): sequence score = sum of the token rewards; group std is unbiased; a group of
one response has mean 0 and std 1 (GRPO) or baseline 0 (RLOO, REINFORCE++-baseline); whitening
uses the unbiased variance and ``rsqrt(var + 1e-8)`` over all valid tokens of the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np
import torch

from megarl.algorithms.registry import Registry
from megarl.algorithms.utils import (
    REWARD_HINT,
    check_finite,
    check_group_index,
    check_response_tensors,
    compact_groups,
    group_mean_std,
    masked_whiten,
)
from megarl.errors import DataError

Uids = Optional[Sequence[object] | np.ndarray]

# How to provide each optional input, quoted when an estimator needs it and it is None.
_HOW_TO_PROVIDE = {
    "group_index": "it compares the responses to the same prompt; pass group_index (B,) int64, "
                   "e.g. group_index_from_uids(batch['uid'])",
    "values": "enable the critic (critic.enable: true or null) so that the batch carries its (B, R) values",
    "baseline_rewards": "pass the (B,) rewards of the greedy responses (the trainer computes them "
                        "when algorithm.adv_estimator = 'remax')",
}


@dataclass(frozen=True, eq=False)
class AdvantageInputs:
    """The batch's tensors an advantage estimator reads. ``B`` responses of ``R`` tokens each."""

    token_level_rewards: torch.Tensor  # (B, R) float: per-token rewards (outcome rewards on the last token)
    response_mask: torch.Tensor  # (B, R) 0/1: 1 on generated tokens; 0 on padding and on observation
    #                              tokens of multi-turn rollouts
    group_index: Optional[torch.Tensor] = None  # (B,) int: equal id <=> responses to the same prompt
    values: Optional[torch.Tensor] = None  # (B, R) float: critic values (GAE)
    baseline_rewards: Optional[torch.Tensor] = None  # (B,) float: reward of the greedy response (ReMax)
    uids: Uids = None  # (B,) prompt uids, only used to name samples in errors

    def require(self, field: str, estimator: str) -> torch.Tensor:
        """The optional tensor ``field`` that ``estimator`` cannot work without.

        Raises DataError naming the estimator, the field and how to provide it, when it is None.
        """
        value = getattr(self, field)
        if value is None:
            raise DataError(f"advantage estimator {estimator!r} needs {field}: {_HOW_TO_PROVIDE[field]}")
        return value


@dataclass(frozen=True)
class AdvantageSettings:
    """The algorithm's constants (from ``algorithm.*`` of the experiment config)."""

    gamma: float = 1.0  # discount (GAE, REINFORCE++)
    lam: float = 1.0  # GAE lambda
    norm_adv_by_std: bool = True  # GRPO / pass@k: divide by the group std (False: Dr.GRPO)
    epsilon: float = 1e-6  # added to the group std
    pass_k: Optional[int] = None  # pass@k: k (None: the group size, as in verl)


DEFAULT_SETTINGS = AdvantageSettings()


class AdvantageEstimator(Protocol):
    def __call__(
        self, inputs: AdvantageInputs, settings: AdvantageSettings = DEFAULT_SETTINGS
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "algorithm.adv_estimator")
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
get_advantage_estimator = ADVANTAGE_ESTIMATORS.get


# Large-batch note: masks are applied by multiplying with a 0/1 float mask and by torch.lerp
# (exact for weights 0 and 1); torch.where with a bool mask is >10x slower on CPU at these sizes.
# Recursions over time (GAE, REINFORCE++) loop over time steps, each step vectorised over samples.


def _checked_rewards(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the common inputs. Returns the mask as 0/1 in the rewards' dtype and the (B,)
    float64 outcome score of each response (the sum of all its token rewards, as verl)."""
    rewards = inputs.token_level_rewards
    check_response_tensors(rewards, inputs.response_mask)
    scores = rewards.sum(dim=-1)
    if not bool(torch.isfinite(scores).all()):  # a NaN/inf reward makes its row's sum non-finite
        check_finite("token_level_rewards", rewards, inputs.uids, hint=REWARD_HINT)  # raises, naming the samples
    return inputs.response_mask.to(rewards.dtype), scores.to(torch.float64)


def _groups(inputs: AdvantageInputs, estimator: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checked (B,) group ids a group-based estimator needs, their compact ids 0..G-1 (B,) and
    the group sizes (G,)."""
    group_index = check_group_index(inputs.require("group_index", estimator), inputs.token_level_rewards.shape[0])
    inverse, sizes = compact_groups(group_index)
    return group_index, inverse, sizes


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, R): the sample's scalar on its valid tokens, 0 elsewhere (in the mask's dtype)."""
    return per_sample.to(mask.dtype).unsqueeze(-1) * mask


SCAN_BLOCK_ROWS = 16384  # rows per time-major block: bounds the extra memory, keeps copies cache-friendly


def _reverse_time_scan(
    scan: Callable[[list[torch.Tensor], torch.Tensor], None], inputs: list[torch.Tensor]
) -> torch.Tensor:
    """Run a recursion backwards over time on (B, R) ``inputs``, vectorised over samples.

    The rows are taken in blocks; each block is copied time-major into reusable (R, n) buffers so
    that the step at time t reads and writes contiguous rows of n samples. ``scan(inputs_t, out_t)``
    fills the (R, n) ``out_t``; the result is assembled into one (B, R) tensor.
    """
    batch, length = inputs[0].shape
    out = torch.empty_like(inputs[0])
    rows = max(1, min(batch, SCAN_BLOCK_ROWS))
    in_buffers = [x.new_empty(length, rows) for x in inputs]
    out_buffer = out.new_empty(length, rows)
    for start in range(0, batch, rows):
        n = min(rows, batch - start)
        block_in = [buf[:, :n] for buf in in_buffers]
        for buf, x in zip(block_in, inputs):
            buf.copy_(x[start : start + n].t())
        scan(block_in, out_buffer[:, :n])
        out[start : start + n].copy_(out_buffer[:, :n].t())
    return out


# ----------------------------------------------------------------------------------------------
# Critic-based and return-based estimators


@register_advantage_estimator("gae")
def compute_gae_advantage_return(
    inputs: AdvantageInputs, settings: AdvantageSettings = DEFAULT_SETTINGS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation; advantages whitened over the batch's valid tokens.

    Needs ``values``; uses ``gamma`` and ``lam``. Masked tokens (padding, multi-turn observations)
    are skipped: the TD error there is not counted and the next value and running advantage are
    carried through them unchanged, so the last generated token before an observation bootstraps
    from the first generated token after it.
    Returns ``(whitened advantages, advantages + values)``, both (B, R).
    """
    mask, _ = _checked_rewards(inputs)
    rewards = inputs.token_level_rewards
    values = inputs.require("values", "gae")
    if values.shape != rewards.shape:
        raise DataError(
            f"gae: values must be a (batch, response_len) tensor from the critic, got {tuple(values.shape)} "
            f"for rewards {tuple(rewards.shape)}"
        )
    check_finite("values", values, inputs.uids,
                 hint="The critic's values must be finite numbers; the critic's forward pass gave NaN or inf for "
                      "these samples (a diverged critic, or an overflow at its precision).")
    values = values.to(rewards.dtype)
    gamma, lam = settings.gamma, settings.lam

    def scan(inputs_t: list[torch.Tensor], adv_t: torch.Tensor) -> None:
        rewards_t, values_t, mask_t = inputs_t
        next_value = rewards_t.new_zeros(rewards_t.shape[1])  # value of the next valid token (0 at end)
        last_adv = rewards_t.new_zeros(rewards_t.shape[1])
        delta = rewards_t.new_empty(rewards_t.shape[1])
        for t in range(rewards_t.shape[0] - 1, -1, -1):
            torch.add(rewards_t[t], next_value, alpha=gamma, out=delta)
            delta.sub_(values_t[t]).add_(last_adv, alpha=gamma * lam)
            # valid token: take the new advantage and value; masked token: carry both through
            torch.lerp(last_adv, delta, mask_t[t], out=adv_t[t])
            last_adv = adv_t[t]
            torch.lerp(next_value, values_t[t], mask_t[t], out=next_value)

    advantages = _reverse_time_scan(scan, [rewards, values, mask])
    returns = (advantages + values).mul_(mask)
    return masked_whiten(advantages, mask, inplace=True), returns


@register_advantage_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage(
    inputs: AdvantageInputs, settings: AdvantageSettings = DEFAULT_SETTINGS
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns ``G_t = r_t + gamma * G_next``, whitened over the batch, where
    ``G_next`` is the return at the next response token of the mask.

    Uses ``gamma``. Masked tokens are not actions: an observation inside a multi-turn rollout passes
    the return through unchanged (undiscounted), so the outcome reward on the last turn reaches the
    earlier turns, as GAE's recursion does; past the last response token the return is 0. On a
    single-turn response (the mask a prefix) this is verl's recursion. Returns ``(whitened returns,
    returns)``, 0 outside the mask.
    """
    mask, _ = _checked_rewards(inputs)
    gamma = settings.gamma

    def scan(inputs_t: list[torch.Tensor], returns_t: torch.Tensor) -> None:
        rewards_t, mask_t = inputs_t
        running = rewards_t.new_zeros(rewards_t.shape[1])
        for t in range(rewards_t.shape[0] - 1, -1, -1):
            torch.add(rewards_t[t], running, alpha=gamma, out=returns_t[t])
            torch.lerp(running, returns_t[t], mask_t[t], out=running)  # masked: keep the return

    returns = _reverse_time_scan(scan, [inputs.token_level_rewards, mask]).mul_(mask)
    return masked_whiten(returns, mask), returns


@register_advantage_estimator("remax")
def compute_remax_advantage(
    inputs: AdvantageInputs, settings: AdvantageSettings = DEFAULT_SETTINGS
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: undiscounted reward-to-go minus the greedy response's reward.

    Needs ``baseline_rewards`` (B,); uses no setting. Returns ``(returns - baseline, returns)`` where
    ``returns`` is the reverse cumulative sum of the masked rewards (no whitening, as in verl).
    """
    mask, _ = _checked_rewards(inputs)
    rewards = inputs.token_level_rewards
    baseline_rewards = inputs.require("baseline_rewards", "remax")
    batch = rewards.shape[0]
    if baseline_rewards.shape != (batch,):
        raise DataError(
            "remax: baseline_rewards must be the (batch,) rewards of the greedy responses, got "
            f"{tuple(baseline_rewards.shape)} for batch {batch}"
        )
    check_finite("baseline_rewards", baseline_rewards, inputs.uids,
                 hint="They are the rewards of these samples' greedy responses (ReMax's baseline); "
                      "check the reward function for those responses.")
    masked_rewards = rewards * mask
    returns = masked_rewards.flip(-1).cumsum(-1).flip(-1) * mask
    advantages = returns - baseline_rewards.to(returns.dtype).unsqueeze(-1) * mask
    return advantages, returns


# ----------------------------------------------------------------------------------------------
# Group-based outcome estimators (one scalar per response, broadcast over its tokens)


@register_advantage_estimator("grpo")
def compute_grpo_outcome_advantage(
    inputs: AdvantageInputs, settings: AdvantageSettings = DEFAULT_SETTINGS
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(s_i - mean_g) / (std_g + epsilon)``; Dr.GRPO (``norm_adv_by_std=False``): ``s_i - mean_g``.

    Needs ``group_index``; uses ``norm_adv_by_std`` and ``epsilon``. ``std_g`` is the unbiased std;
    a one-response group uses mean 0 and std 1. A group whose scores are all equal gets advantage 0.
    Returns ``(advantages, advantages)``.
    """
    mask, scores = _checked_rewards(inputs)
    _, inverse, sizes = _groups(inputs, "grpo")
    mean, std = group_mean_std(scores, inverse, sizes)
    singleton = sizes == 1
    mean = mean.masked_fill(singleton, 0.0)
    std = std.masked_fill(singleton, 1.0)
    centred = scores - mean[inverse]
    scalar = centred / (std[inverse] + settings.epsilon) if settings.norm_adv_by_std else centred
    advantages = _broadcast(scalar, mask)
    return advantages, advantages


@register_advantage_estimator("rloo")
def compute_rloo_outcome_advantage(
    inputs: AdvantageInputs, settings: AdvantageSettings = DEFAULT_SETTINGS
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: ``s_i - mean(s_j, j != i) = n/(n-1) * (s_i - mean_g)``.

    Needs ``group_index``; uses no setting. A one-response group has no other responses: baseline 0,
    advantage ``s_i`` (verl's ``rloo``). Returns ``(advantages, advantages)``.
    """
    mask, scores = _checked_rewards(inputs)
    _, inverse, sizes = _groups(inputs, "rloo")
    mean, _ = group_mean_std(scores, inverse, sizes)
    n = sizes.to(scores.dtype)[inverse]
    scalar = torch.where(n > 1, n / (n - 1).clamp_min(1) * (scores - mean[inverse]), scores)
    advantages = _broadcast(scalar, mask)
    return advantages, advantages


@register_advantage_estimator("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_advantage(
    inputs: AdvantageInputs, settings: AdvantageSettings = DEFAULT_SETTINGS
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline: ``s_i - mean_g`` on every token, whitened over the batch.

    Needs ``group_index``; uses no setting. A one-response group has baseline 0.
    Returns ``(advantages, advantages)``.
    """
    mask, scores = _checked_rewards(inputs)
    _, inverse, sizes = _groups(inputs, "reinforce_plus_plus_baseline")
    mean, _ = group_mean_std(scores, inverse, sizes)
    centred = scores - mean.masked_fill(sizes == 1, 0.0)[inverse]
    advantages = masked_whiten(_broadcast(centred, mask), mask, inplace=True)
    return advantages, advantages


def _log_binomial(n: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """log C(n, k) elementwise (float64); -inf where k < 0 or k > n."""
    valid = (k >= 0) & (k <= n)
    n_, k_ = n.clamp_min(0), k.clamp(min=0)
    k_ = torch.minimum(k_, n_)
    out = torch.lgamma(n_ + 1) - torch.lgamma(k_ + 1) - torch.lgamma(n_ - k_ + 1)
    return torch.where(valid, out, torch.full_like(out, float("-inf")))


def _segment_suffix_sum(x: torch.Tensor, group_end: torch.Tensor) -> torch.Tensor:
    """For contiguous segments: sum of ``x[j]`` over later elements ``j > i`` of the same segment.

    ``group_end`` (B,) is the exclusive end index of each element's segment.
    """
    inclusive = torch.cat([x.flip(0).cumsum(0).flip(0), x.new_zeros(1)])  # inclusive[i] = sum x[i:]
    idx = torch.arange(len(x), device=x.device)
    return inclusive[idx + 1] - inclusive[group_end]


@register_advantage_estimator("grpo_passk")
def compute_grpo_passk_outcome_advantage(
    inputs: AdvantageInputs, settings: AdvantageSettings = DEFAULT_SETTINGS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k (max@k) advantage: the mean, over the k-subsets S of the group that contain i, of
    ``max(S) - max(S without i)`` (leave-one-out credit for the best-of-k objective).

    Needs ``group_index``; uses ``pass_k``, ``norm_adv_by_std`` and ``epsilon``. With
    ``pass_k=None`` k is the group size and this is verl's ``grpo_passk``: the best response
    (the first one on ties) gets ``r_max - r_second_max``, all others 0. Then divided by
    ``std_g + epsilon`` if ``norm_adv_by_std``. Needs 2 <= k <= group size. Returns ``(adv, adv)``.
    """
    mask, scores = _checked_rewards(inputs)
    group_index, inverse, sizes = _groups(inputs, "grpo_passk")
    pass_k = settings.pass_k
    if len(sizes) and int(sizes.min()) < 2:
        g = int((sizes < 2).nonzero()[0])
        first = int((inverse == g).nonzero()[0])
        raise DataError(
            f"grpo_passk needs at least 2 responses per prompt; the group of sample {first} "
            f"(group_index {int(group_index[first])}) has {int(sizes[g])}. Set rollout.n >= 2."
        )
    smallest = int(sizes.min()) if len(sizes) else 0
    if pass_k is not None and (pass_k < 2 or (len(sizes) > 0 and pass_k > smallest)):
        raise DataError(f"grpo_passk: k = {pass_k} must be in [2, smallest group size = {smallest}]")
    k_per_group = sizes if pass_k is None else torch.full_like(sizes, int(pass_k))
    # Order samples by (group, score descending, batch index): sorted position p within the group.
    by_score = torch.argsort(-scores, stable=True)
    order = by_score[torch.argsort(inverse[by_score], stable=True)]
    g_sorted = inverse[order]
    group_start = sizes.cumsum(0) - sizes
    pos = (torch.arange(len(order), device=order.device) - group_start[g_sorted]).to(torch.float64)
    n = sizes[g_sorted].to(torch.float64)
    k = k_per_group[g_sorted].to(torch.float64)
    # Sample at position q is the runner-up max(S without i) for an i above it in C(n-1-q, k-2)
    # of the C(n-1, k-1) k-subsets containing i.
    weight = torch.exp(_log_binomial(n - 1 - pos, k - 2) - _log_binomial(n - 1, k - 1))
    r = scores[order]
    group_end = (group_start + sizes)[g_sorted]
    adv_sorted = r * _segment_suffix_sum(weight, group_end) - _segment_suffix_sum(weight * r, group_end)
    scalar = torch.empty_like(scores)
    scalar[order] = adv_sorted
    if settings.norm_adv_by_std:
        _, std = group_mean_std(scores, inverse, sizes)
        scalar = scalar / (std[inverse] + settings.epsilon)
    advantages = _broadcast(scalar, mask)
    return advantages, advantages
