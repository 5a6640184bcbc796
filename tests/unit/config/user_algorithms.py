"""A user's algorithms module for `algorithm.import_modules` (tests copy it; it is not imported by
pytest: it registers names in the process that imports it)."""

from megarl.algorithms import (get_advantage_estimator, get_policy_loss, register_advantage_estimator,
                               register_kl_estimator, register_policy_loss)


@register_advantage_estimator("plugin_adv")
def plugin_adv(inputs, settings):
    return get_advantage_estimator("grpo")(inputs, settings)


@register_policy_loss("plugin_loss")
def plugin_loss(inputs, settings):
    loss, metrics = get_policy_loss("vanilla")(inputs, settings)
    return loss, {**metrics, "plugin_loss_calls": 1.0}


@register_kl_estimator("plugin_kl")
def plugin_kl(log_prob, ref_log_prob):
    return (log_prob - ref_log_prob).square()
