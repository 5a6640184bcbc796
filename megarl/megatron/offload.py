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


# The groups of engine state that offload separately: a forward pass (log-probs, values, a weight
# sync) needs only "params"; an optimizer step needs all three.
GROUPS = ("params", "grads", "optimizer")


@dataclass
class OffloadState:
    """Tensors whose storage was released, with their CPU copies and the group each belongs to."""

    entries: list[tuple[torch.Tensor, torch.Tensor, str]] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return sum(cpu.numel() * cpu.element_size() for _, cpu, _ in self.entries)

    @property
    def groups(self) -> set[str]:
        """The groups with at least one tensor still in host memory."""
        return {group for _, _, group in self.entries}


def _release(tensor: torch.Tensor, group: str, state: OffloadState, seen: set[int],
             keep: frozenset[int] = frozenset()) -> None:
    """Copy a tensor that owns (the start of) its storage to CPU and free the storage. A storage
    released before (size 0, by an earlier offload of another group) is left as it is, and so is
    one whose address is in `keep` (it belongs to another group)."""
    storage = tensor.untyped_storage()
    if storage.size() == 0 or storage.data_ptr() in seen or storage.data_ptr() in keep:
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
    state.entries.append((tensor, cpu, group))
    storage.resize_(0)


def _ddp_buffers(ddp: Any) -> list[Any]:
    """Megatron DDP's parameter/gradient buffers; none for a model outside DDP (a frozen engine),
    whose `buffers` is `nn.Module.buffers`, a method."""
    found = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = getattr(ddp, name, None)
        if isinstance(value, (list, tuple)):
            found.extend(value)
    return found


def _param_storages(ddp: Any) -> frozenset[int]:
    """Addresses of the storages that hold model parameters (the DDP param buffers, or the
    parameters themselves without the distributed optimizer) and are not released yet."""
    tensors = [buf.param_data for buf in _ddp_buffers(ddp) if getattr(buf, "param_data", None) is not None]
    tensors += [p.data for p in ddp.parameters()]
    return frozenset(t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().size() > 0)


def _optimizer_tensors(optimizer: Any) -> Iterable[torch.Tensor]:
    if optimizer is None:  # a frozen engine
        return
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
            optimizer_state: bool = True, state: OffloadState | None = None) -> OffloadState:
    """Release the chosen groups of tensors to CPU memory, adding to `state` when given (tensors
    already released stay where they are). Returns what `onload` needs. A frozen engine passes its
    bare model (no DDP buffers) and `optimizer=None`: its parameters are all it has to move."""
    state = state if state is not None else OffloadState()
    seen: set[int] = set()
    with torch.no_grad():
        for buf in _ddp_buffers(ddp):
            if params and getattr(buf, "param_data", None) is not None:
                _release(buf.param_data, "params", state, seen)
            if grads and getattr(buf, "grad_data", None) is not None:
                _release(buf.grad_data, "grads", state, seen)
        if params:  # parameters outside DDP buffers (no distributed optimizer)
            for p in ddp.parameters():
                _release(p.data, "params", state, seen)
        if optimizer_state:
            # In fp32 without the distributed optimizer the optimizer steps the model parameters
            # themselves (no separate main copy): they are "params" only, so an optimizer-only
            # offload leaves them in place for the forward passes that onload the params alone.
            keep = _param_storages(ddp)
            for t in _optimizer_tensors(optimizer):
                _release(t.data if isinstance(t, torch.nn.Parameter) else t, "optimizer", state, seen, keep)
    return state


def onload(state: OffloadState, device: torch.device | None = None, groups: Iterable[str] | None = None) -> None:
    """Grow the released storages of `groups` (all when None) back and copy their contents in;
    the other groups stay in `state`."""
    wanted = set(GROUPS if groups is None else groups)
    unknown = wanted - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown offload group(s) {sorted(unknown)}; valid: {list(GROUPS)}")
    back = [e for e in state.entries if e[2] in wanted]
    with torch.no_grad():
        for tensor, cpu, _ in back:
            tensor.untyped_storage().resize_(cpu.numel() * cpu.element_size())
            tensor.copy_(cpu, non_blocking=cpu.is_pinned())
        if any(t.is_cuda for t, _, _ in back):
            torch.cuda.synchronize()
    state.entries[:] = [e for e in state.entries if e[2] not in wanted]
