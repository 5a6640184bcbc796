"""megarl.algorithms: the math of RL post-training, as pure torch functions (no torch.distributed).

Registries let users add their own pieces by name (the names are the config values):

* ``ADVANTAGE_ESTIMATORS`` (``algorithm.adv_estimator``): gae, grpo, rloo, reinforce_plus_plus,
  reinforce_plus_plus_baseline, remax, grpo_passk — ``register_advantage_estimator(name)``; each is
  called as ``estimator(AdvantageInputs, AdvantageSettings)``.
* ``POLICY_LOSSES`` (``actor.policy_loss.loss_mode``): vanilla, gspo, cispo, reinforce/gpg —
  ``register_policy_loss(name)``; each is called as ``loss(PolicyLossInputs, PolicyLossSettings)``.
* ``KL_ESTIMATORS`` (``actor.kl_loss_type``, ``algorithm.kl_penalty``): k1/kl, abs, k2/mse,
  k3/low_var_kl, each with a straight-through ``+`` variant — ``register_kl_estimator(name)``.

Loss aggregation and its micro-batch / data-parallel convention: see ``aggregation``. The
rollout-training mismatch (importance weights, TIS / MIS / IcePop, metrics): see ``rollout_correction``.
"""

from megarl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    AdvantageSettings,
    get_advantage_estimator,
    register_advantage_estimator,
)
from megarl.algorithms.aggregation import (
    LOSS_AGG_MODES,
    LossNormalisers,
    agg_loss,
    aggregate,
    mini_batch_normalisers,
)
from megarl.algorithms.dapo import (
    DynamicSamplingError,
    DynamicSamplingState,
    filter_groups,
    num_groups,
    overlong_penalty,
    sequence_metric,
)
from megarl.algorithms.entropy import entropy_from_logits
from megarl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
    register_kl_estimator,
)
from megarl.algorithms.policy_loss import (
    ADVANTAGE_PROPORTIONAL_LOSSES,
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossInputs,
    PolicyLossSettings,
    get_policy_loss,
    register_policy_loss,
    rows_with_advantage,
    rows_with_advantage_or_one,
)
from megarl.algorithms.registry import Registry
from megarl.algorithms.rollout_correction import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    RolloutCorrectionSettings,
    RolloutMismatchError,
    check_logprob_gap,
    correction_weights,
    importance_weights,
    logprob_gap,
    logprob_gap_uncheckable,
    mismatch_metrics,
    rollout_mismatch_metrics,
)
from megarl.algorithms.utils import group_index_from_uids, masked_mean, masked_whiten
from megarl.algorithms.value_loss import ValueLossInputs, ValueLossSettings, compute_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_PROPORTIONAL_LOSSES",
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AdvantageInputs",
    "AdvantageSettings",
    "DynamicSamplingError",
    "DynamicSamplingState",
    "FixedKLController",
    "LossNormalisers",
    "PolicyLoss",
    "PolicyLossInputs",
    "PolicyLossSettings",
    "Registry",
    "RolloutCorrectionSettings",
    "RolloutMismatchError",
    "ValueLossInputs",
    "ValueLossSettings",
    "agg_loss",
    "aggregate",
    "apply_kl_penalty",
    "check_logprob_gap",
    "compute_value_loss",
    "correction_weights",
    "entropy_from_logits",
    "filter_groups",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_index_from_uids",
    "importance_weights",
    "kl_penalty",
    "logprob_gap",
    "logprob_gap_uncheckable",
    "make_kl_controller",
    "masked_mean",
    "masked_whiten",
    "mini_batch_normalisers",
    "mismatch_metrics",
    "num_groups",
    "overlong_penalty",
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_policy_loss",
    "rollout_mismatch_metrics",
    "rows_with_advantage",
    "rows_with_advantage_or_one",
    "sequence_metric",
]
