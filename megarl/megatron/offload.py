"""Offload parameters, gradients and optimizer state to CPU memory, and bring them back.

The tensors stay the same Python objects (every view Megatron holds into its buffers stays valid):
their contents are copied to CPU memory and their storage is shrunk to 0 bytes, which releases the
accelerator memory; onload grows the storage back and copies the contents in. On a CPU-only machine
the copy lands in the same kind of memory, so nothing is saved, but the same logic runs and is tested.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch


@dataclass
class OffloadState:
    """Tensors whose storage was released, with their CPU copies."""

    entries: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return sum(cpu.numel() * cpu.element_size() for _, cpu in self.entries)


def _release(tensor: torch.Tensor, state: OffloadState, seen: set[int]) -> None:
    """Copy a tensor that owns (the start of) its storage to CPU and free the storage."""
    storage = tensor.untyped_storage()
    if storage.size() == 0 or storage.data_ptr() in seen:
        return
    if tensor.storage_offset() != 0 or tensor.numel() * tensor.element_size() != storage.size():
        # A view into a larger storage: the owner of that storage is released instead.
        return
    seen.add(storage.data_ptr())
    pin = tensor.is_cuda
    cpu = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    cpu.copy_(tensor.detach(), non_blocking=pin)
    if pin:
        torch.cuda.synchronize()
    state.entries.append((tensor, cpu))
    storage.resize_(0)


def _ddp_buffers(ddp: Any) -> list[Any]:
    return list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))


def _optimizer_tensors(optimizer: Any) -> Iterable[torch.Tensor]:
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            yield from group["params"]  # fp32 main params (separate tensors when training in bf16)
        for per_param in inner.state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    yield value


def offload(ddp: Any, optimizer: Any, params: bool = True, grads: bool = True,
            optimizer_state: bool = True) -> OffloadState:
    """Release the chosen groups of tensors to CPU memory. Returns what `onload` needs."""
    state = OffloadState()
    seen: set[int] = set()
    with torch.no_grad():
        for buf in _ddp_buffers(ddp):
            if params and getattr(buf, "param_data", None) is not None:
                _release(buf.param_data, state, seen)
            if grads and getattr(buf, "grad_data", None) is not None:
                _release(buf.grad_data, state, seen)
        if params:  # parameters outside DDP buffers (no distributed optimizer)
            for p in ddp.parameters():
                _release(p.data, state, seen)
        if optimizer_state:
            for t in _optimizer_tensors(optimizer):
                _release(t.data if isinstance(t, torch.nn.Parameter) else t, state, seen)
    return state


def onload(state: OffloadState, device: torch.device | None = None) -> None:
    """Grow every released storage back and copy its contents in."""
    with torch.no_grad():
        for tensor, cpu in state.entries:
            tensor.untyped_storage().resize_(cpu.numel() * cpu.element_size())
            tensor.copy_(cpu, non_blocking=cpu.is_pinned())
        if any(t.is_cuda for t, _ in state.entries):
            torch.cuda.synchronize()
    state.entries.clear()
