"""`swiglu` (the local spec's SwiGLU as one autograd node) against the closed form in float64 and
bit for bit against Megatron's unfused gated activation, and the rule for where it applies.
`LocalMLP` inside Megatron's TP layers and in the engines' models: tests/distributed/test_local_mlp.py."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from megarl.megatron.mlp import swiglu, swiglu_applies

pytestmark = pytest.mark.unit


def _megatron_glu(x: torch.Tensor) -> torch.Tensor:
    """MLP.forward's `glu` at activation_func=F.silu, no clamp, glu_linear_offset=0.0 (Megatron-Core
    0.16, megatron/core/transformer/mlp.py), written out here."""
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    return F.silu(x_glu) * (x_linear + 0.0)


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, 3, 2 * 24, generator=g, dtype=torch.float64) * 4).to(dtype)
    grad = torch.randn(5, 3, 24, generator=g, dtype=torch.float64).to(dtype)
    return x, grad


def test_swiglu_values_and_gradients_match_the_closed_form_in_float64():
    x, grad = _inputs(torch.float64)
    x.requires_grad_()
    y = swiglu(x)
    y.backward(grad)
    gate, up = x.detach()[..., :24], x.detach()[..., 24:]
    sig = 1.0 / (1.0 + torch.exp(-gate))
    # d silu(g)/dg = sig + g * sig * (1 - sig)
    want_y = gate * sig * up
    want_dgate = grad * up * (sig + gate * sig * (1.0 - sig))
    want_dup = grad * gate * sig
    torch.testing.assert_close(y.detach(), want_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad[..., :24], want_dgate, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad[..., 24:], want_dup, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_gives_the_bits_of_megatrons_gated_activation(dtype):
    x, grad = _inputs(dtype, seed=1)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = swiglu(a), _megatron_glu(b)
    ya.backward(grad)
    yb.backward(grad)
    assert ya.dtype == dtype and torch.equal(ya, yb)
    assert torch.equal(a.grad, b.grad)
    with torch.no_grad():
        assert torch.equal(swiglu(x), yb.detach())
    assert torch.equal(swiglu(x), yb.detach())  # gradients on, but x does not require them


def test_swiglu_is_one_autograd_node_without_a_concatenation():
    x, _ = _inputs(torch.float32)
    y = swiglu(x.requires_grad_())
    assert type(y.grad_fn).__name__ == "_SwiGLUBackward"
    assert [type(fn).__name__ for fn, _ in y.grad_fn.next_functions] == ["AccumulateGrad"]  # straight to x
    # The leaf gradient is written in one buffer: no CatBackward anywhere in the graph.
    names = set()
    stack = [y.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is not None:
            names.add(type(fn).__name__)
            stack.extend(f for f, _ in fn.next_functions)
    assert not any("Cat" in n for n in names), names


def _config(**changes):
    values = dict(gated_linear_unit=True, activation_func=F.silu, activation_func_clamp_value=None,
                  glu_linear_offset=0.0, use_te_activation_func=False, bias_activation_fusion=False)
    values.update(changes)
    return types.SimpleNamespace(**values)


def test_swiglu_applies_only_where_it_computes_megatrons_activation():
    assert swiglu_applies(_config())
    for changes in ({"gated_linear_unit": False}, {"activation_func": F.gelu}, {"activation_func_clamp_value": 7.0},
                    {"glu_linear_offset": 1.0}, {"use_te_activation_func": True}, {"bias_activation_fusion": True}):
        assert not swiglu_applies(_config(**changes)), changes
