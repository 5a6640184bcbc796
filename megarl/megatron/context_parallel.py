"""Context parallelism (CP): each CP rank holds part of every sequence; attention spans the group.

Split (Megatron's load-balanced scheme, the one its RoPE `get_pos_emb_on_this_cp_rank` and
TransformerEngine's context-parallel attention assume): the sequence axis, padded to a multiple of
2*cp, is cut into 2*cp equal chunks and CP rank r keeps chunks r and 2*cp-1-r, in that order. Under a
causal mask the early chunk is cheap and the late one expensive, so every rank does the same work.
`shard_index` gives the global positions a rank keeps; `packed_shard_index` applies the same rule to
each sequence of a packed (THD) row separately, which is what TE's THD context parallelism expects.

Attention: with TransformerEngine (GPU) the layer spec's `TEDotProductAttention` does CP itself
(`config.cp_comm_type`, p2p by default) on the same split. The local spec's `DotProductAttention`
refuses cp > 1; its replacement `attention.LocalAttention` all-gathers the keys and values of the
whole group (`gather_keys_values`; backward: reduce-scatter), keeps queries local, and computes the
causal mask from the global positions of the local queries and gathered keys.

Outputs: per-position results (log-probs, entropy, values) are computed on each rank for its own
positions, then `SequenceShard.gather` all-gathers them back into global order. Its backward keeps
only this rank's slice of the incoming gradient, which is right because every CP rank computes the
same loss on the gathered tensor: the gradients reaching the parameters through the ranks' slices
sum, over the CP group, to the full-sequence gradient. Megatron multiplies each micro-batch loss by
the CP size and DDP averages over DP x CP ranks; the two cancel, so gradients equal those at cp=1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.errors import ConfigError


# ---------------------------------------------------------------------- index arithmetic
def cp_alignment(cp: int) -> int:
    """Multiple a sequence (or a packed row) is padded to before it is split: 2*cp, 1 without CP."""
    if cp < 1:
        raise ConfigError(f"context parallel size must be >= 1, got {cp}")
    return 2 * cp if cp > 1 else 1


def padded_length(length: int, cp: int) -> int:
    """`length` rounded up to a multiple of `cp_alignment(cp)`."""
    align = cp_alignment(cp)
    return int(math.ceil(length / align) * align)


def shard_index(width: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """Global positions kept by CP rank `rank` of a sequence axis of `width` (a multiple of 2*cp):
    chunk `rank`, then chunk `2*cp-1-rank`, each `width // (2*cp)` long."""
    if cp == 1:
        return torch.arange(width, device=device)
    if width % (2 * cp) != 0:
        raise ValueError(f"width {width} is not a multiple of 2*cp = {2 * cp}; pad it first")
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} outside [0, {cp})")
    c = width // (2 * cp)
    early = torch.arange(rank * c, (rank + 1) * c, device=device)
    late = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([early, late])


def gathered_positions(width: int, cp: int, device: Any = None) -> torch.Tensor:
    """Global position of each element of an all-gather of the ranks' shards (rank 0's, then 1's ...)."""
    return torch.cat([shard_index(width, cp, r, device) for r in range(cp)])


def packed_shard_index(padded_lengths: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """THD layout: each sequence i of a packed row (padded length `padded_lengths[i]`, a multiple of
    2*cp, starting at the sum of the previous padded lengths) is split on its own; this rank keeps
    its two chunks of every sequence, sequence after sequence."""
    device = padded_lengths.device
    offsets = torch.cumsum(padded_lengths, 0) - padded_lengths
    parts = [int(o) + shard_index(int(n), cp, rank, device) for o, n in zip(offsets, padded_lengths)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def packed_gathered_positions(padded_lengths: torch.Tensor, cp: int) -> torch.Tensor:
    return torch.cat([packed_shard_index(padded_lengths, cp, r) for r in range(cp)])


# ---------------------------------------------------------------------- collectives
class _GatherKeysValues(torch.autograd.Function):
    """All-gather along dim 0 over the CP group. Backward: reduce-scatter, i.e. each rank receives the
    sum over all ranks' queries of the gradient for its own keys/values."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        world = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        world = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


def gather_keys_values(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[s_local, ...] -> [cp * s_local, ...] in rank order (differentiable)."""
    return _GatherKeysValues.apply(x, group)


class _GatherOutputs(torch.autograd.Function):
    """(b, s_local) per rank -> (b, width) in global order. Backward: this rank's slice of the
    gradient only (every CP rank computes the same loss on the gathered tensor; see module doc)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor,  # type: ignore[override]
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.save_for_backward(index)
        world = dist.get_world_size(group)
        s = x.shape[1]
        moved = x.movedim(1, 0).contiguous()  # (s_local, b, ...)
        buf = moved.new_empty((world * s, *moved.shape[1:]))
        dist.all_gather_into_tensor(buf, moved, group=group)
        return buf.index_select(0, inverse).movedim(0, 1).contiguous()  # global order, (b, width, ...)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        return grad.index_select(1, index), None, None, None


@dataclass
class SequenceShard:
    """This CP rank's share of a micro-batch's sequence axis.

    index: (s_local,) global positions this rank holds, in its local order. gathered: (cp*s_local,)
    global position of each element of an all-gather of every rank's local axis. width: the
    padded global length (the axis has positions 0..width-1).
    """

    index: torch.Tensor
    gathered: torch.Tensor
    width: int
    cp: int

    @classmethod
    def contiguous(cls, width: int, cp: int, rank: int, device: Any = None) -> "SequenceShard":
        """Whole-axis split of an axis of `width` (a multiple of 2*cp)."""
        return cls(shard_index(width, cp, rank, device), gathered_positions(width, cp, device), width, cp)

    @classmethod
    def per_sequence(cls, padded_lengths: torch.Tensor, cp: int, rank: int) -> "SequenceShard":
        """THD split of a packed row (each sequence split on its own)."""
        return cls(packed_shard_index(padded_lengths, cp, rank), packed_gathered_positions(padded_lengths, cp),
                   int(padded_lengths.sum()), cp)

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a tensor whose `dim` is the global axis (width long)."""
        if x.shape[dim] != self.width:
            raise ValueError(f"axis {dim} has {x.shape[dim]} positions, the shard plan {self.width}")
        return x.index_select(dim, self.index)

    def gather(self, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """(b, s_local, ...) on every rank -> (b, width, ...) in global order; differentiable (see
        `_GatherOutputs` for the gradient convention)."""
        if self.cp == 1:
            return x
        inverse = torch.argsort(self.gathered)
        return _GatherOutputs.apply(x, self.index, inverse, group)
