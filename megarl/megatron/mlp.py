"""The local layer spec's MLP: Megatron's `MLP` with SwiGLU as one autograd node.

Megatron's unfused gated activation (`bias_activation_fusion=False`, which the local spec needs:
the fused one is `torch.compile`d) computes `silu(gate) * (up + glu_linear_offset)` after a
`torch.chunk` of fc1's output. Under autograd that is an add of the scalar offset (a full pass over
`up` even at offset 0), a saved copy of its result, and in the backward pass a `cat` of the two
halves' gradients into fc1's output gradient. `swiglu` computes the same values with the same
operations in the same order (so the same bits in every dtype), saves fc1's output and the
activation, and writes both halves of the gradient straight into one buffer (one rank's activation
of the ~25M e2e model, forward + backward: benchmarks/local_modules.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gate, up = x.chunk(2, dim=-1)
        activated = F.silu(gate)
        ctx.save_for_backward(x, activated)
        return activated * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x, activated = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        grad_x = torch.empty_like(x)
        grad_gate, grad_up = grad_x.chunk(2, dim=-1)
        torch.mul(grad, activated, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_x


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate, up] along the last dimension (Megatron's fc1 layout per TP
    rank); differentiable, one autograd node. Without gradients it is two passes over the output."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
    return _SwiGLU.apply(x)


def swiglu_applies(config: Any) -> bool:
    """Whether `LocalMLP` computes this config's activation with `swiglu`: SiLU gated linear unit,
    no clamp, no offset, and neither TransformerEngine's activation nor Megatron's fused one."""
    return bool(config.gated_linear_unit and config.activation_func is F.silu
                and config.activation_func_clamp_value is None and config.glu_linear_offset == 0.0
                and not config.use_te_activation_func and not config.bias_activation_fusion)


class LocalMLP(MLP):
    """Megatron's `MLP` (same submodules and parameter names) whose SwiGLU is `swiglu`. Configs
    `swiglu_applies` rejects, and per-token scaling (MoE experts), take Megatron's path."""

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if per_token_scale is not None or not swiglu_applies(self.config):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(swiglu(intermediate))


def use_local_mlps(model: torch.nn.Module) -> int:
    """Make every module of `model` that is exactly Megatron's `MLP` a `LocalMLP` in place (a subclass
    with no state of its own: only `forward` changes); returns how many. Done on the built model
    rather than in the layer spec: Megatron's TransformerLayer hands its TP group to a spec'd module
    only when the module is `MLP` itself."""
    count = 0
    for module in model.modules():
        if type(module) is MLP:
            module.__class__ = LocalMLP
            count += 1
    return count
