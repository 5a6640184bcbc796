"""The loss functions the actor and critic train with, built from typed specs.

The driver resolves the experiment config into an `ActorLossSpec` / `CriticLossSpec`; the roles
build their loss from it. Each builder returns a `loss_fn(outputs, micro_batch, normalisers) ->
(loss, metrics)` for `MegatronEngine.train_step`: `outputs` holds the differentiable
"log_probs"/"entropys" (policy) or "values" (critic) of the micro-batch, `micro_batch` its tensor
columns, `normalisers` the global counts of the mini-batch (so the gradient does not depend on the
micro-batch split).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from megarl.algorithms import (
    LossNormalisers,
    PolicyLossInputs,
    PolicyLossSettings,
    ValueLossInputs,
    ValueLossSettings,
    agg_loss,
    aggregate,
    compute_value_loss,
    get_policy_loss,
    kl_penalty,
)

LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], LossNormalisers], tuple[torch.Tensor, dict[str, Any]]]


@dataclass(frozen=True)
class ActorLossSpec:
    """The actor's loss: policy loss - entropy_coeff * entropy (+ kl_loss_coef * KL to the reference)."""

    loss_mode: str = "vanilla"  # a name in POLICY_LOSSES (actor.policy_loss.loss_mode)
    clip_ratio_low: float = 0.2  # the ratio is kept in [1 - low, 1 + high]
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound (vanilla)
    loss_agg_mode: str = "token-mean"  # for the policy loss, the entropy bonus and the KL loss
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # a KL estimator name (KL_ESTIMATORS, "+" for straight-through)


@dataclass(frozen=True)
class CriticLossSpec:
    """The critic's clipped value loss."""

    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


def make_actor_loss(spec: ActorLossSpec) -> LossFn:
    """Policy loss (+ entropy bonus, + KL loss against the reference) described by `spec`.

    Reads `old_log_probs`, `advantages`, `response_mask` (and `ref_log_prob` with the KL loss) of the
    micro-batch. Metrics: `actor/<policy loss metric>`, `actor/pg_loss`, `actor/entropy` (when
    entropies are computed), `actor/kl_loss` and `actor/kl_coef` (with the KL loss).
    """
    policy_loss = get_policy_loss(spec.loss_mode)
    settings = PolicyLossSettings(
        loss_agg_mode=spec.loss_agg_mode,
        clip_ratio_low=spec.clip_ratio_low,
        clip_ratio_high=spec.clip_ratio_high,
        clip_ratio_c=spec.clip_ratio_c,
    )
    mode = spec.loss_agg_mode

    def loss_fn(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor], normalisers: LossNormalisers):
        log_prob = outputs["log_probs"]
        mask = mb["response_mask"]
        inputs = PolicyLossInputs(mb["old_log_probs"], log_prob, mb["advantages"], mask, normalisers=normalisers)
        loss, metrics = policy_loss(inputs, settings)
        out = {f"actor/{k}": float(v) for k, v in metrics.items()}
        # Metrics are per micro-batch means (the engine averages them); the loss uses the global
        # normalisers so that its gradient does not depend on the split.
        with torch.no_grad():
            local, _ = policy_loss(replace(inputs, log_prob=log_prob.detach(), normalisers=None), settings)
        out["actor/pg_loss"] = float(local)
        if "entropys" in outputs:
            with torch.no_grad():
                out["actor/entropy"] = float(agg_loss(outputs["entropys"].detach(), mask, mode))
            if spec.entropy_coeff:
                loss = loss - spec.entropy_coeff * aggregate(outputs["entropys"], mask, mode, normalisers)
        if spec.use_kl_loss:
            kl = kl_penalty(log_prob, mb["ref_log_prob"], spec.kl_loss_type)
            loss = loss + spec.kl_loss_coef * aggregate(kl, mask, mode, normalisers)
            with torch.no_grad():
                out["actor/kl_loss"] = float(agg_loss(kl.detach(), mask, mode))
            out["actor/kl_coef"] = float(spec.kl_loss_coef)
        return loss, out

    return loss_fn


def make_critic_loss(spec: CriticLossSpec) -> LossFn:
    """Clipped value loss described by `spec`. Reads `returns`, `values`, `response_mask` of the
    micro-batch. Metrics: `critic/vf_clipfrac`, `critic/vpred_mean`, `critic/vf_loss`."""
    settings = ValueLossSettings(cliprange_value=spec.cliprange_value, loss_agg_mode=spec.loss_agg_mode)

    def loss_fn(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor], normalisers: LossNormalisers):
        inputs = ValueLossInputs(outputs["values"], mb["returns"], mb["values"], mb["response_mask"],
                                 normalisers=normalisers)
        loss, metrics = compute_value_loss(inputs, settings)
        out = {f"critic/{k}": float(v) for k, v in metrics.items()}
        with torch.no_grad():
            detached = replace(inputs, vpreds=outputs["values"].detach(), normalisers=None)
            local, _ = compute_value_loss(detached, settings)
        out["critic/vf_loss"] = float(local)
        return loss, out

    return loss_fn
