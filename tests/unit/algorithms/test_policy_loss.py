"""Policy losses: values, gradients and metrics against per-token float64 loops and hand examples."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossInputs,
    PolicyLossSettings,
    get_policy_loss,
)
from megarl.errors import ConfigError

from . import loop_reference as ref

pytestmark = pytest.mark.unit


def random_inputs(seed: int, batch: int = 7, length: int = 6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    # log-ratios up to +-1 (ratios 0.37..2.7): every clip branch occurs; one token past the +-20 clamp
    log_prob = (old + (torch.rand(batch, length, generator=gen, dtype=torch.float64) * 2 - 1)).requires_grad_()
    with torch.no_grad():
        log_prob[0, 0] = old[0, 0] + 25.0
    adv = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length) < lengths.unsqueeze(1)).double()
    mask[3] = 0  # an all-masked row
    return old, log_prob, adv, mask


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("low,high,c", [(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.3, 1.5)])
def test_vanilla_value_gradient_metrics(seed: int, mode: str, low: float, high: float, c: float) -> None:
    old, log_prob, adv, mask = random_inputs(seed)
    loss, metrics = get_policy_loss("vanilla")(
        PolicyLossInputs(old, log_prob, adv, mask),
        PolicyLossSettings(loss_agg_mode=mode, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c),
    )
    loss.backward()
    weights = ref.agg_weights(mask.tolist(), mode)
    exp_loss, clipped, dual, kl, n = 0.0, 0, 0, 0.0, 0
    exp_grad = [[0.0] * old.shape[1] for _ in range(old.shape[0])]
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            if not mask[i, t]:
                continue
            lr = log_prob[i, t].item() - old[i, t].item()
            v, g, was_clipped, was_dual = ref.ppo_token(lr, adv[i, t].item(), low, high, c)
            exp_loss += weights[i][t] * v
            exp_grad[i][t] = weights[i][t] * g
            clipped += was_clipped
            dual += was_dual
            kl += -max(-20.0, min(20.0, lr))
            n += 1
    assert loss.item() == pytest.approx(exp_loss, abs=1e-12)
    torch.testing.assert_close(log_prob.grad, torch.tensor(exp_grad, dtype=torch.float64), atol=1e-12, rtol=0)
    assert metrics["pg_clipfrac"] == pytest.approx(clipped / n)
    assert metrics["ppo_kl"] == pytest.approx(kl / n)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(dual / n)


def test_vanilla_hand_example_clip_higher_and_dual_clip() -> None:
    old = torch.zeros(1, 4, dtype=torch.float64)
    # ratios: 1.5 (A>0: clipped at 1.28), 0.5 (A<0: clipped at 0.8), 5.0 (A<0: dual-clip at 3), 1.1 (A>0)
    log_prob = torch.log(torch.tensor([[1.5, 0.5, 5.0, 1.1]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, -2.0, 0.5]], dtype=torch.float64)
    loss, metrics = get_policy_loss("vanilla")(
        PolicyLossInputs(old, log_prob, adv, torch.ones(1, 4)),
        PolicyLossSettings(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
    )
    per_token = [-1.28, 0.8, 6.0, -0.55]  # -A*clip(r), -A*clip(r), min(-A*r, -A*c) = 6, -A*r
    assert loss.item() == pytest.approx(sum(per_token) / 4)
    loss.backward()
    # Only the last token is unclipped: d(-A r)/d log_prob = -A r = -0.55, over 4 tokens
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.0, 0.0, -0.55 / 4]], dtype=torch.float64))
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 4)  # tokens 0 and 1
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 4)  # token 2


def test_dual_clip_bound_must_exceed_one() -> None:
    old, log_prob, adv, mask = random_inputs(0)
    with pytest.raises(ConfigError, match="clip_ratio_c = 1.0"):
        get_policy_loss("vanilla")(PolicyLossInputs(old, log_prob, adv, mask), PolicyLossSettings(clip_ratio_c=1.0))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_sequence_ratio(seed: int) -> None:
    old, log_prob, adv, mask = random_inputs(seed)
    with torch.no_grad():
        log_prob[0, 0] = old[0, 0] + 0.3  # keep ratios moderate: the +-20 clamp is not part of GSPO
    # GSPO is defined for sequence-level advantages: one advantage per sequence
    adv = adv[:, :1].expand_as(adv).contiguous()
    low, high = 0.2, 0.27
    loss, metrics = get_policy_loss("gspo")(
        PolicyLossInputs(old, log_prob, adv, mask),
        PolicyLossSettings(loss_agg_mode="token-mean", clip_ratio_low=low, clip_ratio_high=high),
    )
    loss.backward()
    rows = [i for i in range(old.shape[0]) if mask[i].sum() > 0]
    exp_loss, clipped, n = 0.0, 0, 0
    exp_grad = torch.zeros_like(old)
    for i in rows:
        tokens = [t for t in range(old.shape[1]) if mask[i, t]]
        s = math.exp(sum(log_prob[i, t].item() - old[i, t].item() for t in tokens) / len(tokens))
        a = adv[i, 0].item()
        unclipped, clip_v = -a * s, -a * min(max(s, 1 - low), 1 + high)
        seq_loss = max(unclipped, clip_v)
        exp_loss += seq_loss / len(rows)  # seq-mean-token-mean whatever loss_agg_mode says
        for t in tokens:
            # value s_i on every token; gradient of the token's own log-prob, scaled by s_i
            exp_grad[i, t] = (-a * s if unclipped >= clip_v else 0.0) / (len(rows) * len(tokens))
            clipped += clip_v > unclipped
            n += 1
    assert loss.item() == pytest.approx(exp_loss, abs=1e-12)
    torch.testing.assert_close(log_prob.grad, exp_grad, atol=1e-12, rtol=0)
    assert metrics["pg_clipfrac"] == pytest.approx(clipped / n)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_cispo_value_and_gradient(seed: int, mode: str) -> None:
    old, log_prob, adv, mask = random_inputs(seed)
    low, high = 0.2, 0.28
    loss, metrics = get_policy_loss("cispo")(
        PolicyLossInputs(old, log_prob, adv, mask),
        PolicyLossSettings(loss_agg_mode=mode, clip_ratio_low=low, clip_ratio_high=high),
    )
    loss.backward()
    weights = ref.agg_weights(mask.tolist(), mode)
    exp_loss, clipped, n = 0.0, 0, 0
    exp_grad = torch.zeros_like(old)
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            if mask[i, t]:
                r = math.exp(max(-20.0, min(20.0, log_prob[i, t].item() - old[i, t].item())))
                w = min(max(r, 1 - low), 1 + high)
                exp_loss += weights[i][t] * (-w * adv[i, t].item() * log_prob[i, t].item())
                exp_grad[i, t] = weights[i][t] * (-w * adv[i, t].item())  # the weight is a constant
                clipped += w != r
                n += 1
    assert loss.item() == pytest.approx(exp_loss, abs=1e-12)
    torch.testing.assert_close(log_prob.grad, exp_grad, atol=1e-12, rtol=0)
    assert metrics["pg_clipfrac"] == pytest.approx(clipped / n)


@pytest.mark.parametrize("name", ["reinforce", "gpg"])
def test_reinforce_value_and_gradient(name: str) -> None:
    old, log_prob, adv, mask = random_inputs(3)
    loss, _ = get_policy_loss(name)(
        PolicyLossInputs(old, log_prob, adv, mask), PolicyLossSettings(loss_agg_mode="seq-mean-token-sum")
    )
    loss.backward()
    weights = ref.agg_weights(mask.tolist(), "seq-mean-token-sum")
    exp_loss = sum(
        weights[i][t] * -adv[i, t].item() * log_prob[i, t].item()
        for i in range(old.shape[0]) for t in range(old.shape[1]) if mask[i, t]
    )
    assert loss.item() == pytest.approx(exp_loss, abs=1e-12)
    torch.testing.assert_close(log_prob.grad, -adv * torch.tensor(weights, dtype=torch.float64))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_all_masked_batch_gives_zero_loss_and_gradient(name: str) -> None:
    old, log_prob, adv, mask = random_inputs(0)
    loss, metrics = get_policy_loss(name)(PolicyLossInputs(old, log_prob, adv, torch.zeros_like(mask)))
    loss.backward()
    assert loss.item() == 0.0
    assert (log_prob.grad == 0).all()
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_on_policy_gradient_is_the_policy_gradient(name: str) -> None:
    # At old == new every loss reduces to the plain policy gradient: d loss / d log_prob = -A * weight.
    _, log_prob, adv, mask = random_inputs(1)
    if name == "gspo":
        adv = adv[:, :1].expand_as(adv).contiguous()
    mode = "seq-mean-token-mean"
    loss, metrics = get_policy_loss(name)(
        PolicyLossInputs(log_prob.detach(), log_prob, adv, mask), PolicyLossSettings(loss_agg_mode=mode)
    )
    loss.backward()
    weights = torch.tensor(ref.agg_weights(mask.tolist(), mode), dtype=torch.float64)
    torch.testing.assert_close(log_prob.grad, -adv * weights)
    assert metrics["ppo_kl"] == 0.0 and metrics["pg_clipfrac"] == 0.0
