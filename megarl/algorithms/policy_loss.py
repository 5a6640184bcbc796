"""Policy-gradient losses: PPO (clip-higher, dual-clip), GSPO, CISPO, REINFORCE/GPG.

Every loss takes the micro-batch's tensors as one ``PolicyLossInputs`` and the actor's constants as
one ``PolicyLossSettings``, so the trainer calls any of them by name::

    inputs = PolicyLossInputs(old_log_prob, log_prob, advantages, response_mask,  # (B, R) each
                              normalisers=normalisers,  # LossNormalisers of the mini-batch
                              weights=None)  # (B, R) per-token multipliers (rollout correction)
    settings = PolicyLossSettings(loss_agg_mode="token-mean",
                                  clip_ratio_low=0.2, clip_ratio_high=0.2,  # ratio kept in [1 - low, 1 + high]
                                  clip_ratio_c=3.0)                         # dual-clip bound (negative advantages)
    loss, metrics = get_policy_loss(name)(inputs, settings)

``loss`` is a scalar with gradient through ``log_prob``, aggregated by ``agg_loss`` (see
aggregation.py for how micro-batch losses add up to the mini-batch loss). ``metrics`` are floats
over this micro-batch's valid tokens: ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` (the mean
of ``old_log_prob - log_prob``, an estimate of KL(old || new)). A user loss registered with
``register_policy_loss(name)`` takes the same two arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from megarl.algorithms.aggregation import LossNormalisers, aggregate
from megarl.algorithms.registry import Registry
from megarl.algorithms.utils import masked_mean
from megarl.errors import ConfigError

LOG_RATIO_CLAMP = 20.0  # verl: exp() of a log-ratio beyond +-20 is clamped for stability
GSPO_LOG_RATIO_MAX = 10.0


@dataclass(frozen=True, eq=False)
class PolicyLossInputs:
    """One micro-batch's tensors, all (B, R): B responses of R tokens."""

    old_log_prob: torch.Tensor  # log-probs of the sampled tokens under the behaviour policy
    log_prob: torch.Tensor  # the same under the current policy, with gradient
    advantages: torch.Tensor
    response_mask: torch.Tensor  # 0/1: 1 on the generated tokens that count in the loss
    normalisers: Optional[LossNormalisers] = None  # of the whole mini-batch; None: this is the mini-batch
    # Per-token multipliers of the loss terms, without gradient (the rollout-mismatch correction,
    # rollout_correction.correction_weights); None: 1. A weight of 0 drops the token's term but
    # keeps it in the normaliser. Every loss applies them to its per-token terms before aggregating.
    weights: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class PolicyLossSettings:
    """The actor's constants (from ``actor.*`` of the experiment config)."""

    loss_agg_mode: str = "token-mean"  # one of aggregation.LOSS_AGG_MODES
    clip_ratio_low: float = 0.2  # the ratio is kept in [1 - low, 1 + high]
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (vanilla only); > 1


DEFAULT_SETTINGS = PolicyLossSettings()


class PolicyLoss(Protocol):
    def __call__(
        self, inputs: PolicyLossInputs, settings: PolicyLossSettings = DEFAULT_SETTINGS
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "actor.policy_loss.loss_mode")
register_policy_loss = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.get

# The built-in losses whose every per-token term is the token's advantage times a factor that stays
# finite (and depends on the token's own row only): a row whose advantages are all zero adds nothing
# to their value or their gradient, so the update may leave it out (actor.skip_zero_advantage_rows).
ADVANTAGE_PROPORTIONAL_LOSSES = frozenset({"vanilla", "gspo", "cispo", "reinforce", "gpg"})


def rows_with_advantage(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the rows of (B, R) `advantages` that are nonzero (or NaN) on some valid token."""
    return ((advantages != 0) & response_mask.bool()).any(dim=-1)


def rows_with_advantage_or_one(advantages: torch.Tensor, response_mask: torch.Tensor,
                               tokens: torch.Tensor) -> torch.Tensor:
    """`rows_with_advantage`, or, where no row has one, the row of fewest `tokens` (B,): for work
    that must run on at least one row (an update's schedule, a pass whose log-probs are checked)."""
    keep = rows_with_advantage(advantages, response_mask)
    if not bool(keep.any()):
        keep[int(tokens.argmin())] = True
    return keep


def _fraction(condition: torch.Tensor, mask: torch.Tensor) -> float:
    return float(masked_mean(condition.to(torch.float32), mask))


def _weighted(losses: torch.Tensor, inputs: PolicyLossInputs) -> torch.Tensor:
    """The per-token terms times `inputs.weights` (when given)."""
    return losses if inputs.weights is None else losses * inputs.weights.detach()


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    inputs: PolicyLossInputs, settings: PolicyLossSettings = DEFAULT_SETTINGS
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with separate low/high clip (DAPO clip-higher) and dual-clip.

    Per token, with ``ratio = exp(clamp(log_prob - old_log_prob, -20, 20))``:
    ``l = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))``; for ``A < 0`` additionally
    ``l = min(l, -A * clip_ratio_c)`` (dual-clip: bounds the loss of a very large ratio).
    ``pg_clipfrac``: share of tokens where the clipped term is active; ``pg_clipfrac_lower``: share
    where the dual-clip bound is active.
    """
    clip_ratio_c = settings.clip_ratio_c
    if clip_ratio_c <= 1.0:
        raise ConfigError(f"actor.clip_ratio_c = {clip_ratio_c}: the dual-clip bound must be > 1.0 (default 3.0)")
    advantages, response_mask = inputs.advantages, inputs.response_mask
    log_ratio = (inputs.log_prob - inputs.old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - settings.clip_ratio_low, 1.0 + settings.clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    losses = _weighted(torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss), inputs)
    loss = aggregate(losses, response_mask, settings.loss_agg_mode, inputs.normalisers)
    metrics = {
        "pg_clipfrac": _fraction(clipped > unclipped, response_mask),
        "pg_clipfrac_lower": _fraction((clip_loss > dual_bound) & negative, response_mask),
        "ppo_kl": float(masked_mean(-log_ratio.detach(), response_mask)),
    }
    return loss, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    inputs: PolicyLossInputs, settings: PolicyLossSettings = DEFAULT_SETTINGS
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (https://arxiv.org/abs/2507.18071): clipping on the sequence-level ratio.

    ``s_i = exp(mean over the sequence's valid tokens of (log_prob - old_log_prob))``; per token the
    ratio is ``sg[s_i] * pi / sg[pi]`` (value ``s_i``, gradient of the token's log-prob), its log
    clamped at 10. Always aggregated with ``seq-mean-token-mean`` as the paper defines it (and as
    verl does); ``loss_agg_mode`` is ignored. ``clip_ratio_c`` is unused (no dual-clip).
    """
    log_prob, advantages, response_mask = inputs.log_prob, inputs.advantages, inputs.response_mask
    mask = response_mask.bool()
    log_ratio = log_prob - inputs.old_log_prob
    seq_len = mask.sum(dim=-1).clamp_min(1).to(log_ratio.dtype)
    seq_log_ratio = torch.where(mask, log_ratio, 0.0).sum(dim=-1) / seq_len
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = token_log_ratio.clamp(max=GSPO_LOG_RATIO_MAX).exp()
    unclipped = -advantages * seq_ratio
    clipped = -advantages * seq_ratio.clamp(1.0 - settings.clip_ratio_low, 1.0 + settings.clip_ratio_high)
    losses = _weighted(torch.maximum(unclipped, clipped), inputs)
    loss = aggregate(losses, response_mask, "seq-mean-token-mean", inputs.normalisers)
    metrics = {
        "pg_clipfrac": _fraction(clipped > unclipped, response_mask),
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": float(masked_mean(-log_ratio.detach(), response_mask)),
    }
    return loss, metrics


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    inputs: PolicyLossInputs, settings: PolicyLossSettings = DEFAULT_SETTINGS
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (https://arxiv.org/abs/2506.13585): ``-sg[clip(ratio, 1 - low, 1 + high)] * A * log_prob``.

    The clipped importance weight carries no gradient, so every token keeps a gradient (no token
    is dropped by clipping). ``pg_clipfrac``: share of tokens whose weight was clipped.
    """
    log_prob, response_mask = inputs.log_prob, inputs.response_mask
    log_ratio = (log_prob - inputs.old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1.0 - settings.clip_ratio_low, 1.0 + settings.clip_ratio_high).detach()
    losses = _weighted(-weight * inputs.advantages * log_prob, inputs)
    loss = aggregate(losses, response_mask, settings.loss_agg_mode, inputs.normalisers)
    metrics = {
        "pg_clipfrac": _fraction(ratio.detach() != weight, response_mask),
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": float(masked_mean(-log_ratio.detach(), response_mask)),
    }
    return loss, metrics


@register_policy_loss("reinforce", "gpg")
def compute_policy_loss_reinforce(
    inputs: PolicyLossInputs, settings: PolicyLossSettings = DEFAULT_SETTINGS
) -> tuple[torch.Tensor, dict[str, float]]:
    """Plain policy gradient (REINFORCE; GPG, https://arxiv.org/abs/2504.02546): ``-A * log_prob``.

    No ratio and no clipping; ``old_log_prob`` is used only for the ``ppo_kl`` metric. Uses only
    ``loss_agg_mode`` of the settings.
    """
    log_prob, response_mask = inputs.log_prob, inputs.response_mask
    losses = _weighted(-inputs.advantages * log_prob, inputs)
    loss = aggregate(losses, response_mask, settings.loss_agg_mode, inputs.normalisers)
    metrics = {
        "pg_clipfrac": 0.0,
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": float(masked_mean((inputs.old_log_prob - log_prob).detach(), response_mask)),
    }
    return loss, metrics
