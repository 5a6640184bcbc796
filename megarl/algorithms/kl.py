"""KL estimators between the policy and the reference, KL-in-reward, and KL coefficient controllers.

Estimators of KL(pi || pi_ref) per token, from the sampled token's log-probs (Schulman, "Approximating
KL divergence", 2020), with ``log_ratio = log_prob - ref_log_prob``:

* ``k1`` / ``kl``: ``log_ratio`` (unbiased, high variance, can be negative)
* ``abs``: ``|log_ratio|``
* ``k2`` / ``mse``: ``0.5 * log_ratio**2``
* ``k3`` / ``low_var_kl``: ``exp(-x) + x - 1`` with ``x = log_ratio`` clamped to [-20, 20], the result
  clamped to [-10, 10] (verl's clamps, for stability)

A ``+`` suffix (``k1+``, ``k3+``, ...) gives the straight-through variant: the forward value of the
estimator with the gradient of ``k2``, whose gradient is the unbiased gradient of the KL
(``k2+`` is ``k2``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from megarl.algorithms.registry import Registry
from megarl.algorithms.utils import check_finite, masked_mean
from megarl.errors import ConfigError, DataError

logger = logging.getLogger(__name__)
KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator", "kl_type")
register_kl_estimator = KL_ESTIMATORS.register


@register_kl_estimator("k1", "kl")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


@register_kl_estimator("abs")
def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


@register_kl_estimator("k2", "mse")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


@register_kl_estimator("k3", "low_var_kl")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    ref_minus_log = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
    return (ref_minus_log.exp() - ref_minus_log - 1.0).clamp(-10.0, 10.0)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate (same shape as the inputs) of the named type, ``+`` for straight-through."""
    straight_through = kl_type.endswith("+")
    base = kl_type[:-1] if straight_through else kl_type
    if base not in KL_ESTIMATORS:
        raise ConfigError(
            f"kl type {kl_type!r}: unknown; valid: {KL_ESTIMATORS.names()}, each optionally with a '+' suffix "
            "(straight-through: forward value of the estimator, gradient of k2). 'full' (whole-vocabulary "
            "KL) is not supported"
        )
    forward = KL_ESTIMATORS.get(base)(log_prob, ref_log_prob)
    if not straight_through or KL_ESTIMATORS.get(base) is kl_k2:
        return forward
    k2 = kl_k2(log_prob, ref_log_prob)
    return k2 - k2.detach() + forward.detach()


_LOG_PROB_HINT = ("The KL in the reward (algorithm.use_kl_in_reward) is computed from these log-probs of the "
                  "response tokens: a NaN or inf there comes from that model's forward pass (an overflow at its "
                  "precision, broken weights), not from the reward function.")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_type: str = "kl",
) -> tuple[torch.Tensor, float]:
    """KL in the reward: ``token_level_rewards = scores - kl_coef * kl`` on valid tokens (all (B, R)).

    Returns the rewards and the batch's mean KL (mean over sequences of each sequence's per-token
    mean, as verl), the value to feed the KL controller's ``update(current_kl, n_steps=B)``.
    A KL that is not finite on a valid token raises DataError naming the log-probs it came from:
    left to the advantage estimator, the NaN reward would be blamed on the reward function. (k3's
    clamp keeps a -inf log-prob finite, as in verl: that passes.)
    """
    valid = response_mask.bool()
    kld = torch.where(valid, kl_penalty(old_log_prob, ref_log_prob, kl_type), 0.0)
    if not bool(torch.isfinite(kld).all()):
        for name, log_prob in (("old_log_prob (the actor's old log-probs)", old_log_prob),
                               ("ref_log_prob (the reference log-probs)", ref_log_prob)):
            check_finite(name, torch.where(valid, log_prob.detach(), 0.0), hint=_LOG_PROB_HINT)
    rewards = token_level_scores - kl_coef * kld
    per_seq = masked_mean(kld, response_mask, dim=-1)
    current_kl = float(per_seq.mean()) if per_seq.numel() else 0.0
    return rewards, current_kl


def _saved_kind(state: dict[str, Any]) -> str:
    """The controller type a `state_dict` came from (written before "type" was: by its keys)."""
    return str(state.get("type", "adaptive" if "target" in state else "fixed"))


def _warn_setting_changed(key: str, now: Any, saved: Any) -> None:
    if saved is not None and saved != now:
        logger.warning("resume: %s is %r in this run's config, %r in the checkpoint: using %r", key, now, saved, now)


class FixedKLController:
    """A constant KL coefficient.

    A resume changes nothing: the coefficient is the config's (algorithm.kl_ctrl.kl_coef), not
    state; a checkpoint's other value is logged.
    """

    STATE_KEYS: tuple[str, ...] = ()  # what a resume takes from the checkpoint (see `kl_state_keys`)

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the interface of AdaptiveKLController)."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if _saved_kind(state) == "fixed":
            _warn_setting_changed("algorithm.kl_ctrl.kl_coef", self.value, float(state["value"]))
        else:
            logger.warning("resume: algorithm.kl_ctrl.type is 'fixed' in this run's config, %r in the checkpoint: "
                           "the KL coefficient is algorithm.kl_ctrl.kl_coef, %r (the checkpoint's controller had "
                           "reached %r)", _saved_kind(state), self.value, float(state["value"]))


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).

    ``update``: ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``.
    A resume restores the coefficient (state); target and horizon stay the config's (settings), each
    one that differs from the checkpoint's is logged.
    """

    STATE_KEYS: tuple[str, ...] = ("value",)

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0:
            raise ConfigError(f"algorithm.kl_ctrl.target_kl = {target_kl}: must be > 0 for the adaptive controller")
        if horizon <= 0:
            raise ConfigError(f"algorithm.kl_ctrl.horizon = {horizon}: must be > 0 for the adaptive controller")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """A KL that is not a finite number raises DataError: a NaN would pass the clip and make the
        coefficient NaN for the rest of the run (and in its checkpoints)."""
        if not math.isfinite(current_kl):
            raise DataError(
                f"algorithm.kl_ctrl (adaptive): the batch's mean KL (current_kl) is {current_kl}, not a finite "
                "number, so the KL coefficient cannot be updated from it: the old or reference log-probs it is "
                "computed from held NaN or inf (apply_kl_penalty names the samples)."
            )
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _warn_setting_changed("algorithm.kl_ctrl.type", "adaptive", _saved_kind(state))
        self.value = float(state["value"])
        _warn_setting_changed("algorithm.kl_ctrl.target_kl", self.target,
                              float(state["target"]) if "target" in state else None)
        _warn_setting_changed("algorithm.kl_ctrl.horizon", self.horizon,
                              int(state["horizon"]) if "horizon" in state else None)


KLController = FixedKLController | AdaptiveKLController


def kl_state_keys(state: dict[str, Any]) -> tuple[str, ...]:
    """The keys of a controller's `state_dict` (``state``, taken from the controller) that a resume
    restores from the checkpoint; the others are the config's settings."""
    kinds = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}
    kind = _saved_kind(state)
    if kind not in kinds:
        raise ConfigError(f"KL controller state of type {kind!r}: unknown; valid: {sorted(kinds)}")
    return kinds[kind].STATE_KEYS


def make_kl_controller(kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000) -> KLController:
    """The controller named by ``algorithm.kl_ctrl.type`` (``fixed`` or ``adaptive``)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ConfigError(f"algorithm.kl_ctrl.type = {kind!r}: unknown; valid: ['adaptive', 'fixed']")
