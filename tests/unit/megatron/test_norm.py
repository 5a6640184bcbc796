"""`rms_norm` / `LocalRMSNorm` (the local spec's RMSNorm with its own backward): the forward bit for
bit against torch's `rms_norm`, and the gradients against float64 autograd within a bound derived
from the float32 arithmetic of the closed form (any summation order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import megarl.megatron.norm as norm
from megarl.megatron.norm import LocalRMSNorm, rms_norm

pytestmark = pytest.mark.unit

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}
SHAPES = [(9, 4, 48), (5, 3, 4, 16)]  # [s, b, h] and a Q/K norm's [s, b, heads, head_dim]


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 0.5).to(dtype)
    w = (1.0 + 0.3 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(dtype)
    grad = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, w, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("eps", [1e-6, None])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_gives_the_bits_of_torchs_rms_norm(dtype, eps, shape, monkeypatch):
    x, w, _ = _inputs(shape, dtype)
    want = F.rms_norm(x, [shape[-1]], w, eps)
    got = rms_norm(x.clone().requires_grad_(), w, eps)  # the autograd function's forward
    assert got.dtype == dtype and torch.equal(got.detach(), want)
    # No gradients: torch's own kernel, not the autograd function (which would fail here).
    monkeypatch.setattr(norm._RMSNorm, "apply", lambda *args: pytest.fail("autograd function without gradients"))
    assert torch.equal(rms_norm(x, w, eps), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_match_float64_within_the_derived_bound(dtype, shape):
    x, w, grad = _inputs(shape, dtype, seed=1)
    n, rows = shape[-1], x.numel() // shape[-1]
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    rms_norm(xg, wg, 1e-6).backward(grad)

    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    F.rms_norm(x64, [n], w64, 1e-6).backward(grad.double())
    with torch.no_grad():
        rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
        x_hat = (x64 * rstd).abs()
        gw = (grad.double() * w64).abs()
        scale = (gw * x_hat).mean(-1, keepdim=True)
        # float32 arithmetic (u) of the closed form, then a cast to dtype (u_out):
        # |d_x error| <= ((3n + 40) u + u_out) * rstd * (|g w| + |x_hat| mean|g w x_hat|)
        # |d_w error| <= ((rows + n + 12) u + u_out) * sum over rows |g x_hat|
        u, u_out = UNIT_ROUNDOFF[torch.float32], UNIT_ROUNDOFF[dtype]
        dx_bound = ((3 * n + 40) * u + u_out) * rstd * (gw + x_hat * scale)
        dw_bound = ((rows + n + 12) * u + u_out) * (grad.double().abs() * x_hat).reshape(-1, n).sum(0)
    assert xg.grad.dtype == dtype and wg.grad.dtype == dtype
    assert bool(((xg.grad.double() - x64.grad).abs() <= dx_bound).all()), (xg.grad.double() - x64.grad).abs().max()
    assert bool(((wg.grad.double() - w64.grad).abs() <= dw_bound).all()), (wg.grad.double() - w64.grad).abs().max()
    # The bound is tight enough to notice a wrong formula: leaving out the mean term breaks it.
    wrong = (grad.double() * w64.detach() * rstd)
    assert not bool(((wrong - x64.grad).abs() <= dx_bound).all())


def test_weight_only_gradients_and_the_module():
    x, w, grad = _inputs(SHAPES[0], torch.float32, seed=2)
    wg = w.clone().requires_grad_()
    rms_norm(x, wg, 1e-6).backward(grad)  # x needs no gradient
    w64 = w.double().requires_grad_()
    F.rms_norm(x.double(), [x.shape[-1]], w64, 1e-6).backward(grad.double())
    torch.testing.assert_close(wg.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)

    torch.manual_seed(0)
    plain = nn.RMSNorm(48, eps=1e-6)
    local = LocalRMSNorm(48, eps=1e-6)
    assert list(local.state_dict()) == list(plain.state_dict()) == ["weight"]
    local.load_state_dict({"weight": w})
    plain.load_state_dict({"weight": w})
    xl = x.clone().requires_grad_()
    out = local(xl)
    assert type(out.grad_fn).__name__ == "_RMSNormBackward"
    assert torch.equal(out, plain(x))
    # Without a weight it is torch's module as it is.
    assert torch.equal(LocalRMSNorm(48, elementwise_affine=False)(x), nn.RMSNorm(48, elementwise_affine=False)(x))
