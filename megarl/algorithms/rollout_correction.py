"""Rollout-training mismatch: importance weights between the rollout engine's and the trainer's
log-probs, their truncated / masked corrections, the mismatch metrics, and the loud gap check.

The rollout engine (vLLM, HF generate, bf16 kernels) and the trainer (Megatron) assign slightly
different log-probs to the same sampled tokens under the same weights. With
``w = exp(trainer_log_prob - rollout_log_prob)`` per token (B, R), the policy gradient of samples
drawn from the rollout engine is corrected by multiplying each token's loss by a function of ``w``
(``algorithm.rollout_correction``):

* ``tis`` (truncated IS): ``min(w, threshold)``;
* ``mis`` (masked IS): ``w`` where ``lower <= w <= upper``, else 0 (the token or sequence is dropped);
* ``icepop``: IcePop's ``M(w) = w`` where ``lower <= w <= upper``, else 0, always per token (the same
  weights as ``mis`` at level ``token``);
* ``reject``: 1 where ``lower <= w <= upper``, else 0 (rejection without importance weighting: what is
  dropped is ``mis``'s, the rest keeps the plain loss; with the rollout log-probs as the old ones the
  PPO ratio already carries ``w``, and this is the one masking mode that does not apply it twice);
* ``none``: 1 (metrics only).

At ``level`` ``sequence`` every token of a response gets the product of its tokens' ``w``; at
``geometric`` their geometric mean. Log-ratios are clamped to +-20 before ``exp`` (verl's bound).
The weights carry no gradient. Dropped tokens keep their place in the loss normaliser (a zero
weight): the loss's denominator does not depend on the correction, and the same formula holds
whichever way the old log-probs were obtained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megarl.algorithms.utils import masked_mean, masked_sum
# Torch-free, defined beside the config check that also needs it; part of this module's interface.
from megarl.config.inert_keys import logprob_gap_uncheckable  # noqa: F401
from megarl.errors import ConfigError, MegarlError

CORRECTION_MODES = ("none", "tis", "mis", "icepop", "reject")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
LOG_RATIO_BOUND = 20.0  # exp() of a log-ratio beyond +-20 is clamped (verl's safety bound)


class RolloutMismatchError(MegarlError, RuntimeError):
    """The rollout engine's log-probs are further from the trainer's than `rollout.max_logprob_gap`."""


@dataclass(frozen=True)
class RolloutCorrectionSettings:
    """``algorithm.rollout_correction.*``: which correction, at which level, with which bounds."""

    mode: str = "none"  # one of CORRECTION_MODES
    level: str = "token"  # one of CORRECTION_LEVELS (icepop: token only)
    threshold: float = 2.0  # tis: weights above it are cut to it
    lower: float = 0.5  # mis, icepop, reject: the band of kept weights [lower, upper]
    upper: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in CORRECTION_MODES:
            raise ConfigError(f"algorithm.rollout_correction.mode = {self.mode!r}; valid: {list(CORRECTION_MODES)}")
        if self.level not in CORRECTION_LEVELS:
            raise ConfigError(f"algorithm.rollout_correction.level = {self.level!r}; valid: {list(CORRECTION_LEVELS)}")


def level_log_ratio(trainer_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                    level: str) -> torch.Tensor:
    """``log w`` at `level`, (B, R), 0 outside `response_mask` (all inputs (B, R)).

    token: ``trainer - rollout`` per token; sequence: its sum over the response's valid tokens, on
    every token of the response; geometric: its mean over them.
    """
    valid = response_mask.bool()
    token = torch.where(valid, trainer_log_prob - rollout_log_prob, torch.zeros_like(trainer_log_prob))
    if level == "token":
        return token
    if level == "sequence":
        per_seq = masked_sum(token, valid, dim=-1)
    elif level == "geometric":
        per_seq = masked_mean(token, valid, dim=-1)
    else:
        raise ConfigError(f"algorithm.rollout_correction.level = {level!r}; valid: {list(CORRECTION_LEVELS)}")
    return torch.where(valid, per_seq.unsqueeze(-1).expand_as(token), torch.zeros_like(token))


def importance_weights(trainer_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       level: str = "token") -> torch.Tensor:
    """``w = exp(clamp(log w, -20, 20))`` at `level` (see `level_log_ratio`), (B, R), 0 outside the mask."""
    log_w = level_log_ratio(trainer_log_prob, rollout_log_prob, response_mask, level)
    return torch.where(response_mask.bool(), log_w.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp(),
                       torch.zeros_like(log_w))


def correction_weights(trainer_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       settings: RolloutCorrectionSettings) -> torch.Tensor:
    """The per-token multiplier of the policy loss, (B, R), detached, 0 outside `response_mask`.

    Inputs (B, R): the trainer's log-probs of the sampled tokens (under the weights that sampled
    them), the rollout engine's, and the 0/1 mask of the response tokens.
    """
    valid = response_mask.bool()
    level = "token" if settings.mode == "icepop" else settings.level
    with torch.no_grad():
        w = importance_weights(trainer_log_prob.detach(), rollout_log_prob, response_mask, level)
        if settings.mode == "none":
            out = valid.to(w.dtype)
        elif settings.mode == "tis":
            out = w.clamp(max=settings.threshold)
        else:
            kept = valid & (w >= settings.lower) & (w <= settings.upper)
            out = torch.where(kept, torch.ones_like(w) if settings.mode == "reject" else w, torch.zeros_like(w))
    return out


def mismatch_metrics(trainer_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                     settings: RolloutCorrectionSettings) -> dict[str, float]:
    """How far the rollout policy is from the trainer's, over the valid tokens of (B, R) inputs.

    ``rollout_corr/kl_k1``: mean of ``rollout - trainer`` (k1 estimate of KL(rollout || trainer)),
    unclamped: the +-20 clamp guards ``exp``, which k1 does not take, and would understate a large gap;
    ``kl_k3``: mean of ``w - log w - 1`` (k3, non-negative; clamped log-ratios, as the weights);
    ``training_ppl`` / ``rollout_ppl``: mean over responses of ``exp(-mean log-prob)``; ``ppl_ratio``:
    mean over responses of their trainer perplexity over their rollout perplexity; ``weight_mean`` /
    ``weight_max``: of ``w`` at the configured level (over tokens at token level, over responses at
    sequence levels); ``applied_weight_mean``: of the loss multiplier; ``masked_token_frac``: share of
    tokens the correction drops; ``masked_seq_frac``: share of responses with at least one dropped token.
    """
    valid = response_mask.bool()
    if not bool(valid.any()):
        return {}
    t, r = trainer_log_prob.detach().double(), rollout_log_prob.detach().double()
    raw_log_w = torch.where(valid, t - r, torch.zeros_like(t))
    log_w = raw_log_w.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    rows = valid.any(dim=-1)
    mean_t = masked_mean(t, valid, dim=-1)[rows]
    mean_r = masked_mean(r, valid, dim=-1)[rows]
    level = "token" if settings.mode == "icepop" else settings.level
    w = importance_weights(t, r, valid, level)
    w_values = w[valid] if level == "token" else _per_response(w, valid)
    applied = correction_weights(t, r, valid, settings)
    dropped = valid & (applied == 0)
    return {
        "rollout_corr/kl_k1": float(masked_mean(-raw_log_w, valid)),
        "rollout_corr/kl_k3": float(masked_mean(log_w.exp() - log_w - 1.0, valid)),
        "rollout_corr/training_ppl": float((-mean_t).exp().mean()),
        "rollout_corr/rollout_ppl": float((-mean_r).exp().mean()),
        "rollout_corr/ppl_ratio": float((mean_r - mean_t).exp().mean()),
        "rollout_corr/weight_mean": float(w_values.mean()),
        "rollout_corr/weight_max": float(w_values.max()),
        "rollout_corr/applied_weight_mean": float(masked_mean(applied, valid)),
        "rollout_corr/masked_token_frac": float(masked_mean(dropped.double(), valid)),
        "rollout_corr/masked_seq_frac": float(dropped.any(dim=-1)[rows].double().mean()),
    }


def _per_response(w: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """One value per response with a valid token, from a (B, R) tensor constant over each response."""
    rows = valid.any(dim=-1)
    first = valid.double().argmax(dim=-1)
    return w.gather(-1, first.unsqueeze(-1)).squeeze(-1)[rows]


def logprob_gap(trainer_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                response_mask: torch.Tensor) -> dict[str, float]:
    """The gap between the rollout engine's and the trainer's log-probs of the same tokens, (B, R) inputs.

    ``training/rollout_logprob_abs_diff_{mean,max}``: of ``|rollout - trainer|`` (nats per token);
    ``training/rollout_probs_diff_{mean,max}``: of ``|exp(rollout) - exp(trainer)|`` (verl's metric,
    a difference of probabilities). Empty when the mask holds no token.
    """
    valid = response_mask.bool()
    t, r = trainer_log_prob.detach().double()[valid], rollout_log_prob.detach().double()[valid]
    if t.numel() == 0:
        return {}
    log_diff = (r - t).abs()
    prob_diff = (r.exp() - t.exp()).abs()
    return {"training/rollout_logprob_abs_diff_mean": float(log_diff.mean()),
            "training/rollout_logprob_abs_diff_max": float(log_diff.max()),
            "training/rollout_probs_diff_mean": float(prob_diff.mean()),
            "training/rollout_probs_diff_max": float(prob_diff.max())}


def rollout_mismatch_metrics(trainer_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                             response_mask: torch.Tensor, settings: RolloutCorrectionSettings) -> dict[str, float]:
    """`logprob_gap` and `mismatch_metrics` of (B, R) inputs, over the response tokens whose trainer
    log-prob is known (NaN marks a row the trainer did not score under the sampling weights).

    A non-finite rollout log-prob marks nothing: it is a fault of the rollout engine that makes the
    correction weights NaN. It stays in the metrics (the gap becomes NaN, which `check_logprob_gap`
    refuses) and ``training/rollout_logprob_num_nonfinite`` counts the response tokens that hold one.
    """
    mask = response_mask.bool() & torch.isfinite(trainer_log_prob)
    nonfinite = response_mask.bool() & ~torch.isfinite(rollout_log_prob)
    return {**logprob_gap(trainer_log_prob, rollout_log_prob, mask),
            "training/rollout_logprob_num_nonfinite": float(nonfinite.sum()),
            **mismatch_metrics(trainer_log_prob, rollout_log_prob, mask, settings)}


def check_logprob_gap(step: int, gap_mean: float, threshold: float | None, where: str = "the response tokens",
                      nonfinite_tokens: float | None = None) -> None:
    """Stop the run when step `step`'s mean |rollout - trainer| log-prob gap over `where` exceeds `threshold`,
    or is not a finite number (`threshold` None: no check).

    A NaN gap fails every comparison, so it is refused by name: it comes from a NaN or infinite
    rollout log-prob (the training batch's checks leave out the rows the trainer did not score), which
    would make the correction weights and the loss NaN. `nonfinite_tokens`
    (``training/rollout_logprob_num_nonfinite``), when the caller has it, is quoted in the message.
    """
    if threshold is None:
        return
    if not math.isfinite(gap_mean):
        count = f" on {int(nonfinite_tokens)} response tokens" if nonfinite_tokens is not None else ""
        raise RolloutMismatchError(
            f"step {step}: the mean |rollout log-prob - trainer log-prob| over {where} is {gap_mean}: the rollout "
            f"log-probs contained non-finite values (NaN or inf){count}, which would make the rollout-correction "
            "weights and the loss NaN. Look for a NaN or an overflow in the rollout engine's forward pass "
            "(rollout.dtype, weights broken by a sync) or for tokens it could not score (rollout.logprobs_mode); "
            "the weight-sync probe compares the trainer's log-probs as they are, and a NaN may be theirs there."
        )
    if not gap_mean > threshold:
        return
    raise RolloutMismatchError(
        f"step {step}: the mean |rollout log-prob - trainer log-prob| over {where} is {gap_mean:.4g} "
        f"nats, above rollout.max_logprob_gap = {threshold:g}. The rollout engine is not sampling from the "
        "policy being trained: most likely the actor's weights did not reach it (a failed or skipped weight "
        "sync, a wrong weight mapping), or the two run at different precisions (rollout.dtype vs model.dtype, "
        "bf16 kernels). Raise rollout.max_logprob_gap (or set it to null) only if this gap is expected."
    )
