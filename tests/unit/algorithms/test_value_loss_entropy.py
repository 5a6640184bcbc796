"""Value loss with clipping, and entropy from logits, against float64 loops."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import (
    LOSS_AGG_MODES,
    ValueLossInputs,
    ValueLossSettings,
    compute_value_loss,
    entropy_from_logits,
)

from . import loop_reference as ref

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("clip", [0.2, 0.5])
def test_value_loss_matches_loop(mode: str, clip: float) -> None:
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    vpreds = (old + torch.randn(6, 5, generator=gen, dtype=torch.float64) * 0.6).requires_grad_()
    returns = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = (torch.arange(5) < torch.tensor([[5], [3], [0], [1], [4], [2]])).double()
    loss, metrics = compute_value_loss(ValueLossInputs(vpreds, returns, old, mask),
                                       ValueLossSettings(cliprange_value=clip, loss_agg_mode=mode))
    loss.backward()
    weights = ref.agg_weights(mask.tolist(), mode)
    exp_loss, clipped, n = 0.0, 0, 0
    exp_grad = torch.zeros_like(old)
    for i in range(6):
        for t in range(5):
            if mask[i, t]:
                term, grad, was_clipped = ref.value_loss_token(vpreds[i, t].item(), returns[i, t].item(),
                                                               old[i, t].item(), clip)
                exp_loss += 0.5 * weights[i][t] * term
                exp_grad[i, t] = 0.5 * weights[i][t] * grad
                clipped += was_clipped
                n += 1
    assert loss.item() == pytest.approx(exp_loss, abs=1e-12)
    torch.testing.assert_close(vpreds.grad, exp_grad, atol=1e-12, rtol=0)
    assert metrics["vf_clipfrac"] == pytest.approx(clipped / n)


def test_value_loss_hand_example() -> None:
    # old 0, clip 0.5: vpred 2 -> clipped 0.5; return 1: max((2-1)^2, (0.5-1)^2) = 1 (unclipped)
    # vpred -1, return 1: clipped -0.5 -> max(4, 2.25) = 4; vpred 0.2, return -3: max(10.24, 10.24)
    vpreds = torch.tensor([[2.0, -1.0, 0.2]])
    clip = ValueLossSettings(cliprange_value=0.5)
    loss, _ = compute_value_loss(
        ValueLossInputs(vpreds, torch.tensor([[1.0, 1.0, -3.0]]), torch.zeros(1, 3), torch.ones(1, 3)), clip
    )
    assert loss.item() == pytest.approx(0.5 * (1 + 4 + 10.24) / 3)
    # vpred 2 with return 3: clipped 0.5 -> (0.5-3)^2 = 6.25 > 1: the clipped term is used
    loss, metrics = compute_value_loss(
        ValueLossInputs(torch.tensor([[2.0]]), torch.tensor([[3.0]]), torch.zeros(1, 1), torch.ones(1, 1)), clip
    )
    assert loss.item() == pytest.approx(0.5 * 6.25) and metrics["vf_clipfrac"] == 1.0


def test_entropy_matches_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 17, generator=gen, dtype=torch.float64) * 3
    out = entropy_from_logits(logits)
    expected = [[ref.entropy(v) for v in row] for row in logits.tolist()]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=1e-12)


def test_entropy_hand_values_and_extremes() -> None:
    uniform = torch.zeros(1, 8)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(8), rel=1e-6)
    # huge logits (would overflow a naive exp) and -inf (banned tokens)
    logits = torch.tensor([[1e4, 1e4, float("-inf"), -1e4]], dtype=torch.float32, requires_grad=True)
    out = entropy_from_logits(logits)
    assert out.item() == pytest.approx(math.log(2), rel=1e-6)
    out.sum().backward()
    assert torch.isfinite(logits.grad).all()
    one_hot = torch.tensor([[0.0, float("-inf"), float("-inf")]])
    assert entropy_from_logits(one_hot).item() == 0.0
    assert torch.isnan(entropy_from_logits(torch.tensor([[0.0, float("nan")]]))).all()  # NaN is not hidden
