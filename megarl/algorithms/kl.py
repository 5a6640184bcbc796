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

from collections.abc import Callable
from typing import Any

import torch

from megarl.algorithms.registry import Registry
from megarl.algorithms.utils import masked_mean
from megarl.errors import ConfigError

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
    """
    kld = torch.where(response_mask.bool(), kl_penalty(old_log_prob, ref_log_prob, kl_type), 0.0)
    rewards = token_level_scores - kl_coef * kld
    per_seq = masked_mean(kld, response_mask, dim=-1)
    current_kl = float(per_seq.mean()) if per_seq.numel() else 0.0
    return rewards, current_kl


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the interface of AdaptiveKLController)."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).

    ``update``: ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0:
            raise ConfigError(f"algorithm.kl_ctrl.target_kl = {target_kl}: must be > 0 for the adaptive controller")
        if horizon <= 0:
            raise ConfigError(f"algorithm.kl_ctrl.horizon = {horizon}: must be > 0 for the adaptive controller")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000) -> KLController:
    """The controller named by ``algorithm.kl_ctrl.type`` (``fixed`` or ``adaptive``)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ConfigError(f"algorithm.kl_ctrl.type = {kind!r}: unknown; valid: ['adaptive', 'fixed']")
