"""Registries: users add their own estimator or loss by name; clear errors otherwise."""

from __future__ import annotations

import pytest
import torch

from megarl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    AdvantageSettings,
    PolicyLossInputs,
    PolicyLossSettings,
    Registry,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage_estimator,
    register_policy_loss,
)
from megarl.errors import ConfigError

pytestmark = pytest.mark.unit


def test_builtin_names() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {
        "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "grpo_passk"
    }
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "cispo", "gpg", "reinforce"}


def test_user_estimator_and_loss_are_found_by_name() -> None:
    registry_names = set(ADVANTAGE_ESTIMATORS)

    @register_advantage_estimator("test_only_constant")
    def constant(inputs: AdvantageInputs, settings: AdvantageSettings = AdvantageSettings()):
        adv = torch.ones_like(inputs.token_level_rewards) * inputs.response_mask
        return adv, adv

    @register_policy_loss("test_only_zero")
    def zero(inputs: PolicyLossInputs, settings: PolicyLossSettings = PolicyLossSettings()):
        return (inputs.log_prob * 0).sum(), {}

    try:
        adv, _ = get_advantage_estimator("test_only_constant")(AdvantageInputs(torch.zeros(2, 3), torch.ones(2, 3)))
        assert adv.sum() == 6
        assert get_policy_loss("test_only_zero") is zero
        assert register_advantage_estimator("test_only_constant")(constant) is constant  # same fn again: fine
        with pytest.raises(ValueError, match="'test_only_constant' is already registered"):
            register_advantage_estimator("test_only_constant")(lambda *a, **k: None)
    finally:  # keep the global registries as they were for other tests
        ADVANTAGE_ESTIMATORS._fns.pop("test_only_constant")
        POLICY_LOSSES._fns.pop("test_only_zero")
    assert set(ADVANTAGE_ESTIMATORS) == registry_names


def test_unknown_names_list_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match=r"actor.policy_loss.loss_mode = 'ppo'.*\['cispo', 'gpg', 'gspo'"):
        get_policy_loss("ppo")
    registry: Registry = Registry("widget", "x.widget")
    with pytest.raises(ConfigError, match=r"x.widget = 'a': unknown widget; registered: \[\]"):
        registry.get("a")
    with pytest.raises(ValueError, match="non-empty strings"):
        registry.register("")(print)
