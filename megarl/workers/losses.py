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
from typing import Any, Callable, Optional

import torch

from megarl.algorithms import (
    ADVANTAGE_PROPORTIONAL_LOSSES,
    LossNormalisers,
    PolicyLossInputs,
    PolicyLossSettings,
    RolloutCorrectionSettings,
    ValueLossInputs,
    ValueLossSettings,
    agg_loss,
    aggregate,
    compute_value_loss,
    correction_weights,
    get_policy_loss,
    kl_penalty,
    rows_with_advantage,
)
from megarl.config.plugins import import_modules
from megarl.errors import ConfigError

LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], LossNormalisers], tuple[torch.Tensor, dict[str, Any]]]
# Receives each micro-batch's data and its log-probs under the weights of the update, detached.
LogProbSink = Callable[[dict[str, torch.Tensor], torch.Tensor], None]
# Where the PPO ratio's old log-probs come from (actor.old_log_prob_source, "auto" resolved on the
# driver): the actor's forward pass before the update (the batch's `old_log_probs`), the update's
# own log-probs detached, or the rollout engine's (the driver puts them in `old_log_probs`).
OLD_LOG_PROB_SOURCES = ("recompute", "update", "rollout")


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
    old_log_prob_source: str = "recompute"  # one of OLD_LOG_PROB_SOURCES
    # The update leaves out the rows whose advantage is zero on every response token (they still
    # count in the loss's normalisers). Resolved on the driver (actor.skip_zero_advantage_rows): only
    # where `zero_advantage_rows_add_nothing` holds, so that the gradient stays what it was.
    skip_zero_advantage_rows: bool = False
    # Rollout-training mismatch correction (algorithm.rollout_correction): per-token loss weights.
    rollout_correction: RolloutCorrectionSettings = RolloutCorrectionSettings()
    # algorithm.import_modules (.py paths absolute): imported before the loss is built, for the policy
    # losses and KL estimators they register in this process.
    import_modules: tuple[str, ...] = ()


def zero_advantage_rows_add_nothing(spec: ActorLossSpec) -> bool:
    """Whether a row whose advantages are all zero adds nothing to the actor loss or its gradient: a
    built-in policy loss proportional to the advantage, no entropy bonus, no KL loss (whose terms do
    not depend on the advantage). A user-registered loss is not assumed to be proportional. Nothing
    else in the update sees a row: the models train without dropout and a MoE router without a
    load-balancing loss (`megarl.models.spec`)."""
    return spec.loss_mode in ADVANTAGE_PROPORTIONAL_LOSSES and not spec.entropy_coeff and not spec.use_kl_loss


def own_where_left_out(old_log_prob: torch.Tensor, own: torch.Tensor, advantages: torch.Tensor,
                       response_mask: torch.Tensor) -> torch.Tensor:
    """`old_log_prob` (B, R) with the rows that the old-log-prob pass left out (NaN there: zero
    advantage, `RLTrainer.old_log_probs_of_rows_run`) replaced by the update's own log-probs `own`,
    detached: such a row runs only where its rank's mini-batch holds no other (`rows_to_run`), and
    with ratio 1 and zero advantage it adds nothing. A row of nonzero advantage keeps its NaN: a pass
    that failed to cover it is a bug to surface, not to hide."""
    left_out = torch.isnan(old_log_prob).any(dim=-1) & ~rows_with_advantage(advantages, response_mask)
    if not bool(left_out.any()):
        return old_log_prob
    return torch.where(left_out.unsqueeze(-1), own, old_log_prob)


@dataclass(frozen=True)
class CriticLossSpec:
    """The critic's clipped value loss."""

    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


def make_actor_loss(spec: ActorLossSpec, log_prob_sink: Optional[LogProbSink] = None) -> LossFn:
    """Policy loss (+ entropy bonus, + KL loss against the reference) described by `spec`.

    Reads `advantages`, `response_mask`, `old_log_probs` (unless the source is "update": the
    update's own log-probs, detached, so the ratio is exactly 1 and the gradient is the vanilla policy
    gradient), `ref_log_prob` with the KL loss and `rollout_log_probs` with a rollout correction.
    The correction's importance weights compare the trainer's log-probs under the sampling weights
    (the recomputed `old_log_probs`; otherwise the update's own, which equal them when the update is
    on-policy) with the rollout engine's. `log_prob_sink`, when given, receives every micro-batch's
    data and detached log-probs. With `skip_zero_advantage_rows` and the pass, a row the pass left
    out takes the update's own log-probs (`own_where_left_out`). Metrics: `actor/<policy loss metric>`, `actor/pg_loss`,
    `actor/entropy` (when entropies are computed), `actor/kl_loss` and `actor/kl_coef` (with the KL loss).
    """
    if spec.old_log_prob_source not in OLD_LOG_PROB_SOURCES:
        raise ConfigError(f"actor.old_log_prob_source = {spec.old_log_prob_source!r}; the loss takes one of "
                          f"{list(OLD_LOG_PROB_SOURCES)} (auto is resolved by the driver)")
    if spec.skip_zero_advantage_rows and not zero_advantage_rows_add_nothing(spec):
        raise ConfigError(f"the actor loss ({spec.loss_mode}, entropy_coeff {spec.entropy_coeff}, use_kl_loss "
                          f"{spec.use_kl_loss}) gets a gradient from rows of zero advantage: the update cannot skip "
                          f"them (only with a loss in {sorted(ADVANTAGE_PROPORTIONAL_LOSSES)}, no entropy bonus, no "
                          "KL loss)")
    import_modules(spec.import_modules)
    policy_loss = get_policy_loss(spec.loss_mode)
    settings = PolicyLossSettings(
        loss_agg_mode=spec.loss_agg_mode,
        clip_ratio_low=spec.clip_ratio_low,
        clip_ratio_high=spec.clip_ratio_high,
        clip_ratio_c=spec.clip_ratio_c,
    )
    mode = spec.loss_agg_mode
    source, correction = spec.old_log_prob_source, spec.rollout_correction

    def loss_fn(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor], normalisers: LossNormalisers):
        log_prob = outputs["log_probs"]
        detached = log_prob.detach()
        if log_prob_sink is not None:
            log_prob_sink(mb, detached)
        mask = mb["response_mask"]
        old = detached if source == "update" else mb["old_log_probs"]
        if spec.skip_zero_advantage_rows and source == "recompute":
            old = own_where_left_out(old, detached, mb["advantages"], mask)
        weights = None
        if correction.mode != "none":
            trainer = old if source == "recompute" else detached
            weights = correction_weights(trainer, mb["rollout_log_probs"], mask, correction)
        inputs = PolicyLossInputs(old, log_prob, mb["advantages"], mask, normalisers=normalisers, weights=weights)
        loss, metrics = policy_loss(inputs, settings)
        out = {f"actor/{k}": float(v) for k, v in metrics.items()}
        # Metrics are per micro-batch means (the engine averages them); the loss uses the global
        # normalisers so that its gradient does not depend on the split.
        with torch.no_grad():
            local, _ = policy_loss(replace(inputs, log_prob=detached, normalisers=None), settings)
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
