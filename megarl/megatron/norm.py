"""The local layer spec's RMSNorm: torch's `nn.RMSNorm` with a backward pass of its own.

On CPU torch computes `rms_norm` as a chain of operations (upcast, square, mean, rsqrt, two
multiplies, downcast), and autograd differentiates each of them in turn, each a pass over a tensor of
the input's size (on CUDA torch has fused kernels for both directions, and `rms_norm` leaves CUDA
tensors to them). `rms_norm` computes the forward with
the same operations in the same order (so the same bits in every dtype) and saves the input and the
reciprocal RMS (one number a row); its backward is the closed form

    x_hat = x * rstd
    d_x   = rstd * (g*w - x_hat * mean(g*w * x_hat))      (mean over the normalised dimension)
    d_w   = sum over rows of g * x_hat

in float32 (float64 for float64 inputs), cast to the input's and the weight's dtypes. Forward and
backward on one rank of the ~25M e2e model: benchmarks/local_modules.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _computation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        upcast = x.to(_computation_dtype(x.dtype))
        rstd = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, rstd, weight)
        return (upcast * rstd).mul_(weight).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        x, rstd, weight = ctx.saved_tensors
        dtype = _computation_dtype(x.dtype)
        x_hat = x.to(dtype) * rstd
        grad = grad.to(dtype)
        grad_x_hat = grad * weight.to(dtype)
        mean = (grad_x_hat * x_hat).mean(-1, keepdim=True)
        grad_x = torch.addcmul(grad_x_hat, x_hat, mean, value=-1).mul_(rstd)
        grad_weight = (grad * x_hat).reshape(-1, x.shape[-1]).sum(0)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """`torch.nn.functional.rms_norm(x, [x.shape[-1]], weight, eps)` (the same values), with the
    closed-form backward above when gradients flow on CPU. `eps` None: float32's machine epsilon
    (float64's for float64), as torch."""
    if eps is None:
        eps = torch.finfo(_computation_dtype(x.dtype)).eps
    if x.device.type == "cpu" and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return nn.functional.rms_norm(x, [x.shape[-1]], weight, eps)


class LocalRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` over the last dimension with a weight (same parameter), computed by `rms_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None or len(self.normalized_shape) != 1:
            return super().forward(x)
        return rms_norm(x, self.weight, self.eps)
