"""Core attention of the local (non-TransformerEngine) layer spec: `LocalAttention`.

Megatron's local spec uses `DotProductAttention`, which materialises the [b, heads, sq, sk] score
matrix, masks it, takes an fp32 softmax and multiplies by the values as separate kernels; it refuses
context parallelism. `LocalAttention` computes the same function with torch's
`scaled_dot_product_attention` (a fused kernel that never stores the probabilities: flash or
memory-efficient attention on CUDA, the flash CPU kernel on CPU; the short rows of a
half-precision CPU training step instead go through `explicit_attention`, which is faster there:
`prefers_explicit_attention`) and, at cp > 1, first all-gathers keys and values over the context-parallel group
(`context_parallel.gather_keys_values`), keeping queries local. It is the local spec's core
attention whenever the model's attention is plain softmax attention; sliding-window and
off-by-one/learnable softmax keep Megatron's `DotProductAttention` at cp = 1 and are refused at cp > 1.

Masks follow Megatron's convention: `attention_mask` is a bool tensor broadcastable to
[b, heads, sq, sk], True = masked; None means causal (over global positions at cp > 1). Every query
must see at least one key (every mask megarl builds lets a position see itself).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from megarl.errors import ConfigError
from megarl.megatron.context_parallel import gather_keys_values, gathered_positions, shard_index
from megarl.megatron.spec_rewrite import replace_modules


# Longest key length at which a half-precision CPU training step computes attention with
# `explicit_attention` instead of torch's flash kernel. On CPU the flash kernel's backward in
# bf16/fp16 costs a few ms per row whatever the row's length, while explicit attention's cost grows
# with length squared. benchmarks/attention.py (one thread, 8 query / 4 key-value heads of 64, a
# padding mask; forward + backward, explicit / torch's math kernel / flash): 64 rows of 36 keys
# 38 / 48 / 157 ms, 32 of 68 40 / 55 / 135 ms, 16 of 128 61 / 70 / 96 ms, 8 of 192 48 / 74 / 50 ms.
# In fp32 and without gradients the flash kernel is kept.
HALF_PRECISION_EXPLICIT_MAX_KEYS = 128

# Causal masks a `LocalAttention` keeps, one per query length (most recently used): a run with dynamic
# micro-batches meets a new padded length at nearly every micro-batch, and keeping them all held
# gigabytes per layer (one [sq, cp*sq] mask per length: 2.7 GiB for the lengths up to 4,096 at cp = 2).
CAUSAL_MASKS_KEPT = 4


def prefers_explicit_attention(query: torch.Tensor, keys: int) -> bool:
    """Whether `LocalAttention` computes this call with `explicit_attention` rather than torch's
    fused kernel: on CPU, in bf16 or fp16, when gradients will flow, over at most
    `HALF_PRECISION_EXPLICIT_MAX_KEYS` keys. It materialises the [b, heads, sq, sk] scores, which at
    that length are small."""
    return (query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)
            and torch.is_grad_enabled() and query.requires_grad and keys <= HALF_PRECISION_EXPLICIT_MAX_KEYS)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: Optional[torch.Tensor],
                       scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Softmax attention as separate fp32 operations, for autograd to differentiate: q [b, np, sq, hn],
    k/v [b, ng, sk, hn] with query head h reading key/value group h // (np / ng) (torch's
    `enable_gqa`); `masked` a bool mask broadcastable to [b, np, sq, sk], True = masked (Megatron's
    convention), every query seeing at least one key; None: every key visible. Returns [b, np, sq, hn] in q's dtype.

    Scores, softmax and the weighted sum run in fp32 (as torch's math kernel computes half-precision
    inputs on CPU), but each query group is one batched matmul against its key/value head (no copy
    of the keys per query head) and the mask is one fill, where the math kernel also scans every
    score row for being fully masked."""
    b, heads, sq, hn = q.shape
    groups, sk = k.shape[1], k.shape[2]
    per_group = heads // groups
    # copy=True: a new contiguous fp32 tensor, so that the in-place scaling never touches q.
    qf = q.to(torch.float32, memory_format=torch.contiguous_format, copy=True).mul_(scale)
    scores = torch.matmul(qf.view(b, groups, per_group * sq, hn), k.float().transpose(-1, -2))
    scores = scores.view(b, groups, per_group, sq, sk)
    if masked is not None:
        if masked.dim() >= 3 and masked.shape[-3] == heads and heads > 1:  # one mask per query head
            masked = masked.reshape(*masked.shape[:-3], groups, per_group, sq, sk)
        else:  # one mask for all heads: [..., 1, sq, sk] or [sq, sk]
            masked = masked.unsqueeze(-3)
        # The most negative finite value rather than -inf: a fully masked row (which megarl's masks
        # never make) then averages its values instead of turning into NaN.
        scores = scores.masked_fill(masked, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs.view(b, groups, per_group * sq, sk), v.float())
    return out.view(b, heads, sq, hn).to(q.dtype)


def local_attention_supported(config: Any) -> str | None:
    """Why `LocalAttention` cannot compute this config's attention; None when it can."""
    if config.softmax_type != "vanilla":
        return f"softmax_type={config.softmax_type!r} (valid: 'vanilla')"
    if config.window_size is not None:
        return f"sliding-window attention (window_size={config.window_size})"
    return None


class LocalAttention(torch.nn.Module):
    """Drop-in for Megatron's `DotProductAttention` (same constructor and call): query [sq, b, np, hn],
    key/value [sk, b, ng, hn] for this rank's positions; output [sq, b, np*hn]. Scaling is
    1/sqrt(hn) (or `softmax_scale`); query-key layer scaling divides and re-multiplies the scores by
    the layer number, which cancels, so it is not applied. Attention dropout runs inside the model-parallel
    RNG tracker like `DotProductAttention`'s."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Any = None) -> None:
        super().__init__()
        unsupported = local_attention_supported(config)
        if unsupported is not None:
            raise ConfigError(f"LocalAttention: {unsupported} is not implemented; Megatron's DotProductAttention "
                              "(context_parallel_size=1) or TransformerEngine computes it")
        self.config = config
        self.causal = attn_mask_type == AttnMaskType.causal
        tp_group = getattr(pg_collection, "tp", None) or ps.get_tensor_model_parallel_group()
        self.cp_group = getattr(pg_collection, "cp", None) or ps.get_context_parallel_group()
        self.cp = self.cp_group.size()
        self.cp_rank = self.cp_group.rank()
        self.heads = config.num_attention_heads // tp_group.size()
        self.hidden_per_partition = config.kv_channels * self.heads
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # The causal masks of the last few query lengths: a step's micro-batches (and their backward
        # passes) reuse them, while a run meets many lengths over its steps.
        self._masks: OrderedDict[tuple[int, str], torch.Tensor] = OrderedDict()

    def _causal_mask(self, sq: int, device: torch.device) -> torch.Tensor:
        """[sq, cp*sq] True = masked: this CP rank's queries against the gathered keys. The last
        `CAUSAL_MASKS_KEPT` lengths' masks are kept."""
        key = (sq, str(device))
        if key in self._masks:
            self._masks.move_to_end(key)
            return self._masks[key]
        width = sq * self.cp
        q_pos = shard_index(width, self.cp, self.cp_rank, device)
        k_pos = gathered_positions(width, self.cp, device)
        mask = self._masks[key] = k_pos.unsqueeze(0) > q_pos.unsqueeze(1)
        while len(self._masks) > CAUSAL_MASKS_KEPT:
            self._masks.popitem(last=False)
        return mask

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Any = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ConfigError("attention on the local layer spec takes packed rows with an explicit attention "
                              "mask, not packed_seq_params (THD needs TransformerEngine)")
        if attention_bias is not None:
            raise ConfigError("attention on the local layer spec does not take an attention bias")
        sq, b, np_, hn = query.shape
        if self.cp > 1:  # one collective for both: [sq, b, ng, 2*hn] -> [cp*sq, b, ng, 2*hn]
            kv = gather_keys_values(torch.cat([key, value], dim=-1), self.cp_group)
            key, value = kv[..., :hn], kv[..., hn:]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        explicit = prefers_explicit_attention(q, k.shape[2])
        masked = attention_mask  # True = masked; None: causal (or nothing) without a mask tensor
        if masked is None and self.causal and (self.cp > 1 or explicit):
            masked = self._causal_mask(sq, query.device)  # over the CP-gathered keys at cp > 1
        dropout_p = self.dropout_p if self.training else 0.0

        def attend() -> torch.Tensor:
            if explicit:
                return explicit_attention(q, k, v, masked, self.softmax_scale, dropout_p)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=None if masked is None else ~masked,
                                                  dropout_p=dropout_p, is_causal=masked is None and self.causal,
                                                  scale=self.softmax_scale, enable_gqa=k.shape[1] != np_)

        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_per_partition)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> dict:
        return {}  # no parameters, no extra state


def with_local_attention(layer_spec: Any, config: Any) -> Any:
    """A copy of a local-spec layer (or block) spec whose core attention is `LocalAttention`.

    At cp = 1 the spec is returned unchanged when the attention is one `LocalAttention` does not
    compute (`local_attention_supported`); at cp > 1, where `DotProductAttention` cannot run, that is
    a ConfigError, as is a spec with no `DotProductAttention` to replace."""
    cp = config.context_parallel_size
    unsupported = local_attention_supported(config)
    if unsupported is not None:
        if cp == 1:
            return layer_spec
        raise ConfigError(f"context_parallel_size={cp} on the local layer spec: {unsupported} is not "
                          "implemented; use context_parallel_size=1 or TransformerEngine")

    def is_dpa(node: Any) -> bool:
        return node is DotProductAttention or (isinstance(node, ModuleSpec) and node.module is DotProductAttention)

    spec, replaced = replace_modules(layer_spec, is_dpa, LocalAttention)
    if not replaced and cp > 1:
        raise ConfigError(
            "context_parallel_size > 1 without TransformerEngine needs the local layer spec's "
            "DotProductAttention, which this model's layer spec does not use; use context_parallel_size=1")
    return spec
