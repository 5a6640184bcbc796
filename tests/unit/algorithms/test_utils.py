"""Masked whitening, finiteness checks and group helpers."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.utils import check_finite, compact_groups, group_mean_std, masked_mean, masked_whiten
from megarl.errors import DataError

pytestmark = pytest.mark.unit


def test_masked_whiten_hand_example() -> None:
    values = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # mean 2, unbiased variance ((1 + 0 + 1) / 2) = 1; the masked 100 is ignored and set to 0
    scale = 1 / math.sqrt(1 + 1e-8)
    torch.testing.assert_close(masked_whiten(values, mask), torch.tensor([[-scale, 0.0], [scale, 0.0]]))
    assert values[1, 1] == 100.0  # not modified unless inplace
    out = masked_whiten(values, mask, inplace=True)
    assert out is values and values[1, 1] == 0.0


def test_masked_whiten_degenerate_masks() -> None:
    values = torch.tensor([[5.0, 7.0]])
    assert masked_whiten(values, torch.tensor([[0, 1]])).tolist() == [[0.0, 0.0]]  # one valid token
    assert masked_whiten(values, torch.zeros(1, 2)).tolist() == [[0.0, 0.0]]
    assert masked_whiten(torch.zeros(0, 3), torch.zeros(0, 3)).shape == (0, 3)


def test_masked_whiten_float32_large_batch_accuracy() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(4000, 300, generator=gen) * 3 + 50  # a large mean: cancellation-prone
    mask = torch.rand(4000, 300, generator=gen) > 0.3
    out = masked_whiten(values, mask).double()
    v64 = values.double()[mask]
    expected = (v64 - v64.mean()) / torch.sqrt(v64.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(out[mask], expected, atol=2e-5, rtol=0)


def test_masked_mean_ignores_nan_outside_mask() -> None:
    values = torch.tensor([[1.0, float("nan")], [3.0, 4.0]])
    mask = torch.tensor([[1, 0], [1, 1]])
    assert masked_mean(values, mask).item() == pytest.approx(8 / 3)
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.0, 3.5]))
    assert masked_mean(values, torch.zeros(2, 2)).item() == 0.0


def test_check_finite() -> None:
    check_finite("x", torch.full((2, 3), 3e38))  # finite values whose row sums overflow: no error
    check_finite("x", torch.zeros(0, 4))
    bad = torch.zeros(8, 2)
    bad[[1, 2, 3, 4, 5, 7], 1] = float("inf")
    with pytest.raises(DataError, match=r"non-finite values in 6 sample\(s\): sample 1: inf at position 1.*and 1 more"):
        check_finite("x", bad)
    with pytest.raises(DataError, match=r"sample 1: inf at position 1; .*and 1 more\. Look here\.$"):
        check_finite("x", bad, hint="Look here.")
    with pytest.raises(DataError) as caught:  # no hint: no guess at where the values came from
        check_finite("x", bad)
    assert str(caught.value).endswith("and 1 more")


def test_group_helpers() -> None:
    inverse, sizes = compact_groups(torch.tensor([40, 7, 40, 40, 9]))
    assert inverse.tolist() == [2, 0, 2, 2, 1] and sizes.tolist() == [1, 1, 3]
    mean, std = group_mean_std(torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0], dtype=torch.float64), inverse, sizes)
    torch.testing.assert_close(mean, torch.tensor([2.0, 7.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(std, torch.tensor([0.0, 0.0, 2.0], dtype=torch.float64))  # stdev(1, 3, 5) = 2
