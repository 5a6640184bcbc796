"""The loss functions the actor and critic train with, built from the experiment config.

Each returns a `loss_fn(outputs, micro_batch, normalisers) -> (loss, metrics)` for
`MegatronEngine.train_step`: `outputs` holds the differentiable "log_probs"/"entropys" (policy) or
"values" (critic) of the micro-batch, `micro_batch` its tensor columns, `normalisers` the global
counts of the mini-batch (so the gradient does not depend on the micro-batch split).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from megarl.algorithms import LossNormalisers, agg_loss, compute_value_loss, get_policy_loss, kl_penalty

LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], LossNormalisers], tuple[torch.Tensor, dict[str, Any]]]


def _norm_kwargs(normalisers: LossNormalisers) -> dict[str, Any]:
    return {
        "global_num_tokens": normalisers.global_num_tokens,
        "global_num_seqs": normalisers.global_num_seqs,
        "max_response_len": normalisers.max_response_len,
        "dp_size": normalisers.dp_size,
    }


def make_actor_loss(actor: Any) -> LossFn:
    """Policy loss (+ entropy bonus, + KL loss against the reference) from the `actor` config section."""
    policy_loss = get_policy_loss(actor.policy_loss.loss_mode)
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    mode = actor.loss_agg_mode

    def loss_fn(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor], normalisers: LossNormalisers):
        log_prob = outputs["log_probs"]
        mask = mb["response_mask"]
        kwargs = dict(loss_agg_mode=mode, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=actor.clip_ratio_c)
        loss, metrics = policy_loss(mb["old_log_probs"], log_prob, mb["advantages"], mask,
                                    normalisers=normalisers, **kwargs)
        out = {f"actor/{k}": float(v) for k, v in metrics.items()}
        # Metrics are per micro-batch means (the engine averages them); the loss uses the global
        # normalisers so that its gradient does not depend on the split.
        with torch.no_grad():
            local, _ = policy_loss(mb["old_log_probs"], log_prob.detach(), mb["advantages"], mask, **kwargs)
        out["actor/pg_loss"] = float(local)
        if "entropys" in outputs:
            with torch.no_grad():
                out["actor/entropy"] = float(agg_loss(outputs["entropys"].detach(), mask, mode))
            if actor.entropy_coeff:
                loss = loss - actor.entropy_coeff * agg_loss(outputs["entropys"], mask, mode, **_norm_kwargs(normalisers))
        if actor.use_kl_loss:
            kl = kl_penalty(log_prob, mb["ref_log_prob"], actor.kl_loss_type)
            loss = loss + actor.kl_loss_coef * agg_loss(kl, mask, mode, **_norm_kwargs(normalisers))
            with torch.no_grad():
                out["actor/kl_loss"] = float(agg_loss(kl.detach(), mask, mode))
            out["actor/kl_coef"] = float(actor.kl_loss_coef)
        return loss, out

    return loss_fn


def make_critic_loss(critic: Any) -> LossFn:
    """Clipped value loss from the `critic` config section."""

    def loss_fn(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor], normalisers: LossNormalisers):
        kwargs = dict(cliprange_value=critic.cliprange_value, loss_agg_mode=critic.loss_agg_mode)
        loss, metrics = compute_value_loss(outputs["values"], mb["returns"], mb["values"], mb["response_mask"],
                                           normalisers=normalisers, **kwargs)
        out = {f"critic/{k}": float(v) for k, v in metrics.items()}
        with torch.no_grad():
            local, _ = compute_value_loss(outputs["values"].detach(), mb["returns"], mb["values"], mb["response_mask"], **kwargs)
        out["critic/vf_loss"] = float(local)
        return loss, out

    return loss_fn
