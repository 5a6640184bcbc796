"""KL estimators, straight-through variants, KL-in-reward and the KL controllers."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)
from megarl.errors import ConfigError, DataError

pytestmark = pytest.mark.unit


def reference_kl(lp: float, ref_lp: float, kind: str) -> float:
    d = lp - ref_lp
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    x = max(-20.0, min(20.0, ref_lp - lp))  # k3: ratio - log(ratio) - 1 of pi_ref / pi
    return max(-10.0, min(10.0, math.exp(x) - x - 1.0))


KINDS = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]


def pairs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(6, 5, generator=gen, dtype=torch.float64) * 4
    ref_lp = -torch.rand(6, 5, generator=gen, dtype=torch.float64) * 4
    ref_lp[0, 0] = lp[0, 0] + 30.0  # past the input clamp
    ref_lp[0, 1] = lp[0, 1] - 30.0  # output clamp: exp(-20) + 20 - 1 > 10
    ref_lp[0, 2] = lp[0, 2] + 3.0  # output clamp: exp(3) - 3 - 1 = 16.1 > 10
    return lp, ref_lp


@pytest.mark.parametrize("kind", KINDS)
def test_estimators_match_formulas(kind: str) -> None:
    lp, ref_lp = pairs()
    out = kl_penalty(lp, ref_lp, kind)
    expected = [[reference_kl(a, b, kind) for a, b in zip(r1, r2)] for r1, r2 in zip(lp.tolist(), ref_lp.tolist())]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=1e-12)


def test_k3_clamps() -> None:
    lp, ref_lp = pairs()
    out = kl_penalty(lp, ref_lp, "low_var_kl")
    assert out[0, 0].item() == 10.0  # input clamped to 20: exp(20) - 21 -> output clamped to 10
    assert out[0, 1].item() == 10.0  # input -30 -> -20: exp(-20) + 19 -> 10
    assert out[0, 2].item() == 10.0
    assert out.max().item() <= 10.0 and out.min().item() >= 0.0  # k3 is non-negative


@pytest.mark.parametrize("base", ["k1", "kl", "abs", "k3", "low_var_kl", "k2"])
def test_straight_through_variants(base: str) -> None:
    lp, ref_lp = pairs()
    lp = lp.requires_grad_()
    out = kl_penalty(lp, ref_lp, base + "+")
    torch.testing.assert_close(out.detach(), kl_penalty(lp.detach(), ref_lp, base))  # forward: the estimator
    out.sum().backward()
    torch.testing.assert_close(lp.grad, (lp - ref_lp).detach())  # gradient: that of k2 = 0.5 d^2


def test_k3_gradient_without_straight_through() -> None:
    lp = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    ref_lp = torch.tensor([-1.5], dtype=torch.float64)
    kl_penalty(lp, ref_lp, "k3").sum().backward()
    # d/d lp of exp(ref - lp) - (ref - lp) - 1 = -exp(ref - lp) + 1
    assert lp.grad.item() == pytest.approx(1.0 - math.exp(-0.5))


def test_unknown_kl_type() -> None:
    lp, ref_lp = pairs()
    with pytest.raises(ConfigError, match=r"kl type 'full'.*'k3'.*not supported"):
        kl_penalty(lp, ref_lp, "full")


def test_apply_kl_penalty() -> None:
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]], dtype=torch.float64)
    ref_lp = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, current_kl = apply_kl_penalty(scores, old, ref_lp, mask, kl_coef=0.1, kl_type="kl")
    # k1 = old - ref: [[0.5, -1, 0], [1, 0, (masked)]]
    expected = torch.tensor([[-0.05, 0.1, 1.0], [-0.1, 2.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(rewards, expected)
    assert current_kl == pytest.approx(((0.5 - 1 + 0) / 3 + (1 + 0) / 2) / 2)


@pytest.mark.parametrize("which", ["old", "ref"])
def test_kl_in_reward_names_non_finite_log_probs(which: str) -> None:
    """A NaN log-prob gives a NaN KL-shaped reward: the message names the log-probs, not the reward function."""
    scores = torch.zeros(2, 3)
    old, ref_lp = torch.full((2, 3), -1.0), torch.full((2, 3), -1.2)
    (old if which == "old" else ref_lp)[1, 1] = float("nan")
    name = {"old": r"old_log_prob \(the actor's old log-probs\)", "ref": r"ref_log_prob \(the reference log-probs\)"}
    with pytest.raises(DataError, match=rf"{name[which]}: non-finite values in 1 sample\(s\): sample 1: nan at "
                                        r"position 1\..*not from the reward function"):
        apply_kl_penalty(scores, old, ref_lp, torch.ones(2, 3), kl_coef=0.1, kl_type="kl")
    masked = torch.tensor([[1, 1, 1], [1, 0, 1]])  # the NaN on a padding token: no KL there, no error
    rewards, current_kl = apply_kl_penalty(scores, old, ref_lp, masked, kl_coef=0.1, kl_type="kl")
    assert bool(torch.isfinite(rewards).all()) and math.isfinite(current_kl)


def test_k3_keeps_its_clamp_for_an_impossible_reference_token() -> None:
    """k3 clamps the log-ratio (verl): a -inf reference log-prob gives a finite KL, as before."""
    ref_lp = torch.tensor([[-float("inf"), -1.0]])
    rewards, current_kl = apply_kl_penalty(torch.zeros(1, 2), torch.full((1, 2), -1.0), ref_lp, torch.ones(1, 2),
                                           kl_coef=0.1, kl_type="k3")
    assert bool(torch.isfinite(rewards).all()) and math.isfinite(current_kl)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_adaptive_controller_refuses_a_non_finite_kl(bad: float) -> None:
    ctrl = AdaptiveKLController(0.1, 0.1, 100)
    with pytest.raises(DataError, match=r"mean KL .* is (nan|inf).*log-probs"):
        ctrl.update(bad, 1)
    assert ctrl.value == 0.1  # the coefficient is untouched


def test_fixed_controller() -> None:
    ctrl = make_kl_controller("fixed", kl_coef=0.05)
    ctrl.update(current_kl=100.0, n_steps=1000)
    assert isinstance(ctrl, FixedKLController) and ctrl.value == 0.05
    fresh = FixedKLController(0.05)
    fresh.load_state_dict(ctrl.state_dict())
    assert fresh.value == 0.05 and fresh.state_dict() == ctrl.state_dict()


def test_adaptive_controller_hand_computed() -> None:
    ctrl = make_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10000)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(current_kl=9.0, n_steps=256)  # error 0.5 -> clipped to 0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    ctrl.update(current_kl=5.4, n_steps=100)  # error -0.1, inside the clip
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000) * (1 - 0.1 * 100 / 10000))
    ctrl.update(current_kl=0.0, n_steps=500)  # error -1 -> -0.2
    expected = 0.1 * (1 + 0.2 * 256 / 10000) * (1 - 0.1 * 100 / 10000) * (1 - 0.2 * 500 / 10000)
    assert ctrl.value == pytest.approx(expected)
    resumed = AdaptiveKLController(1.0, 6.0, 10000)  # the same config: only the coefficient is state
    resumed.load_state_dict(ctrl.state_dict())
    resumed.update(7.0, 10)
    ctrl.update(7.0, 10)
    assert resumed.value == ctrl.value and resumed.state_dict() == ctrl.state_dict()


def test_resume_keeps_the_configs_kl_settings(caplog: pytest.LogCaptureFixture) -> None:
    """The coefficient an adaptive controller reached is state and is restored; target_kl and
    horizon, and a fixed controller's coefficient, are settings: a changed config wins, with a warning."""
    saved = make_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10000)
    saved.update(current_kl=9.0, n_steps=256)
    resumed = make_kl_controller("adaptive", kl_coef=0.1, target_kl=3.0, horizon=500)
    with caplog.at_level("WARNING", logger="megarl.algorithms.kl"):
        resumed.load_state_dict(saved.state_dict())
    assert resumed.value == saved.value and (resumed.target, resumed.horizon) == (3.0, 500)
    assert "algorithm.kl_ctrl.target_kl is 3.0 in this run's config, 6.0 in the checkpoint" in caplog.text
    assert "algorithm.kl_ctrl.horizon is 500 in this run's config, 10000 in the checkpoint" in caplog.text
    resumed.update(current_kl=3.0, n_steps=100)  # on target under the new setting: no change
    assert resumed.value == saved.value

    caplog.clear()
    same = make_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10000)
    with caplog.at_level("WARNING", logger="megarl.algorithms.kl"):
        same.load_state_dict(saved.state_dict())
        same.load_state_dict({"value": 0.5, "target": 6.0, "horizon": 10000})  # written before "type"
    assert same.value == 0.5 and caplog.text == ""

    fixed = make_kl_controller("fixed", kl_coef=0.02)
    with caplog.at_level("WARNING", logger="megarl.algorithms.kl"):
        fixed.load_state_dict(make_kl_controller("fixed", kl_coef=0.05).state_dict())
    assert fixed.value == 0.02 and "algorithm.kl_ctrl.kl_coef is 0.02 in this run's config, 0.05" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="megarl.algorithms.kl"):
        fixed.load_state_dict({"value": 0.5, "target": 6.0, "horizon": 10000})  # an adaptive run's, before "type"
    assert fixed.value == 0.02 and "type is 'fixed' in this run's config, 'adaptive' in the checkpoint" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="megarl.algorithms.kl"):
        same.load_state_dict({"type": "fixed", "value": 0.03})  # switched to adaptive: starts at the old coefficient
    assert same.value == 0.03 and "type is 'adaptive' in this run's config, 'fixed' in the checkpoint" in caplog.text


def test_controller_config_errors() -> None:
    with pytest.raises(ConfigError, match="horizon = 0"):
        make_kl_controller("adaptive", 0.1, target_kl=0.1, horizon=0)
    with pytest.raises(ConfigError, match="target_kl = 0"):
        make_kl_controller("adaptive", 0.1, target_kl=0.0, horizon=10)
    with pytest.raises(ConfigError, match="kl_ctrl.type = 'pid'"):
        make_kl_controller("pid", 0.1)
