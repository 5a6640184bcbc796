"""Context parallelism (CP): each CP rank holds part of every sequence; attention spans the group.

Split (Megatron's load-balanced scheme, the one its RoPE `get_pos_emb_on_this_cp_rank` and
TransformerEngine's context-parallel attention assume): the sequence axis, padded to a multiple of
2*cp, is cut into 2*cp equal chunks and CP rank r keeps chunks r and 2*cp-1-r, in that order. Under a
causal mask the early chunk is cheap and the late one expensive, so every rank does the same work.
`shard_index` gives the global positions a rank keeps; `packed_shard_index` applies the same rule to
each sequence of a packed (THD) row separately, which is what TE's THD context parallelism expects.

Attention: with TransformerEngine (GPU) the layer spec's `TEDotProductAttention` does CP itself
(`config.cp_comm_type`, p2p by default) on the same split. The local spec's `DotProductAttention`
refuses cp > 1, so `with_context_parallel_attention` puts `ContextParallelAttention` in its place:
keys and values of the whole group are all-gathered (backward: reduce-scatter), queries stay local,
and the causal mask is computed from the global positions of the local queries and gathered keys.

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
from typing import Any, Optional

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


# ---------------------------------------------------------------------- attention
class ContextParallelAttention(torch.nn.Module):
    """Core attention for the local (non-TE) layer spec at cp > 1.

    Drop-in for Megatron's `DotProductAttention` (same constructor and call; query [sq, b, np, hn],
    key/value [sq, b, ng, hn] for this rank's positions; output [sq, b, np*hn]). Keys and values of
    all CP ranks are gathered; the sequence axis this rank holds is the whole-axis split of
    `shard_index` with width sq * cp. `attention_mask`, when given, is a bool tensor broadcastable
    to [b, np, sq, cp*sq], True = masked, whose key axis is in gathered order (`gathered_positions`);
    when None the mask is causal over global positions. Softmax, scaling and dropout follow
    `DotProductAttention` (scores scaled by 1/sqrt(hn), masked with -10000, softmax in fp32 for
    half-precision inputs when `attention_softmax_in_fp32`).
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Any = None) -> None:
        super().__init__()
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.enums import AttnMaskType

        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.causal = attn_mask_type == AttnMaskType.causal
        if config.softmax_type != "vanilla":
            raise ConfigError(
                f"context parallel attention (local spec): softmax_type={config.softmax_type!r} is not "
                "implemented; valid: 'vanilla' (or use TransformerEngine on GPU)"
            )
        if config.window_size is not None:
            raise ConfigError(
                "context parallel attention (local spec): sliding-window attention (window_size="
                f"{config.window_size}) is not implemented; use context_parallel_size=1 or TransformerEngine"
            )
        tp_group = getattr(pg_collection, "tp", None) or ps.get_tensor_model_parallel_group()
        self.cp_group = getattr(pg_collection, "cp", None) or ps.get_context_parallel_group()
        tp = tp_group.size()
        self.cp = self.cp_group.size()
        self.cp_rank = self.cp_group.rank()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        head_dim = config.kv_channels
        self.hidden_per_partition = head_dim * self.heads
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.coeff = None
        if config.apply_query_key_layer_scaling:
            self.coeff = float(self.layer_number)
            self.softmax_scale /= self.coeff
        self.softmax_in_fp32 = bool(config.attention_softmax_in_fp32)
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)
        self._positions: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def _causal_mask(self, sq: int, device: torch.device) -> torch.Tensor:
        key = (sq, str(device))
        if key not in self._positions:
            width = sq * self.cp
            self._positions[key] = (shard_index(width, self.cp, self.cp_rank, device),
                                    gathered_positions(width, self.cp, device))
        q_pos, k_pos = self._positions[key]
        return k_pos.unsqueeze(0) > q_pos.unsqueeze(1)  # [sq, sk] True = masked

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Any = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None) -> torch.Tensor:
        from megatron.core import tensor_parallel

        if packed_seq_params is not None:
            raise ConfigError("context parallel attention (local spec) takes packed rows with an explicit "
                              "attention mask, not packed_seq_params (THD needs TransformerEngine)")
        if attention_bias is not None:
            raise ConfigError("context parallel attention (local spec) does not take an attention bias")
        sq, b, np_, hn = query.shape
        # One collective for both: [sq, b, ng, 2*hn] -> [cp*sq, b, ng, 2*hn].
        kv = gather_keys_values(torch.cat([key, value], dim=-1), self.cp_group)
        key, value = kv[..., :hn], kv[..., hn:]
        sk = key.shape[0]
        if self.heads // self.groups > 1:  # GQA, as DotProductAttention: repeat each group's K/V
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)

        q = query.reshape(sq, b * np_, hn).transpose(0, 1)  # [b*np, sq, hn]
        k = key.reshape(sk, b * np_, hn).transpose(0, 1)  # [b*np, sk, hn]
        scores = torch.baddbmm(q.new_empty(b * np_, sq, sk), q, k.transpose(1, 2), beta=0.0,
                               alpha=self.softmax_scale).view(b, np_, sq, sk)
        half = scores.dtype in (torch.float16, torch.bfloat16)
        if half and self.softmax_in_fp32:
            scores = scores.float()
        if self.coeff is not None:
            scores = scores * self.coeff
        mask = attention_mask
        if mask is None and self.causal:
            mask = self._causal_mask(sq, scores.device)
        if mask is not None:
            scores = scores.masked_fill(mask, -10000.0)
        probs = torch.softmax(scores, dim=-1)
        if half and self.softmax_in_fp32:
            probs = probs.to(query.dtype)
        if not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.dropout(probs)
        else:
            probs = self.dropout(probs)

        v = value.reshape(sk, b * np_, hn).transpose(0, 1)  # [b*np, sk, hn]
        context = torch.bmm(probs.reshape(b * np_, sq, sk), v)  # [b*np, sq, hn]
        context = context.view(b, np_, sq, hn).permute(2, 0, 1, 3).contiguous()
        return context.view(sq, b, self.hidden_per_partition)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> dict:
        return {}  # no parameters, no extra state


def with_context_parallel_attention(layer_spec: Any) -> Any:
    """A copy of a local-spec layer (or block) spec whose core attention is `ContextParallelAttention`.
    Raises ConfigError if the spec has no `DotProductAttention` to replace."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megarl.megatron.spec_rewrite import replace_modules

    def is_dpa(node: Any) -> bool:
        return node is DotProductAttention or (isinstance(node, ModuleSpec) and node.module is DotProductAttention)

    spec, replaced = replace_modules(layer_spec, is_dpa, ContextParallelAttention)
    if not replaced:
        raise ConfigError(
            "context_parallel_size > 1 without TransformerEngine needs the local layer spec's "
            "DotProductAttention, which this model's layer spec does not use; use context_parallel_size=1"
        )
    return spec
