"""`LocalAttention` (the local layer spec's core attention, torch's fused kernel) against dense
float64 attention worked out here, and the spec rewrite that puts it in place of Megatron's
DotProductAttention. At cp > 1 it runs in tests/distributed/test_engine_cp.py against HF."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.errors import ConfigError
from megarl.megatron.attention import LocalAttention, with_local_attention
from megarl.megatron.packing import CompactRows, pack_rows

pytestmark = pytest.mark.unit


class _OneRank:
    """A process group of one rank: all LocalAttention asks of its TP and CP groups at cp = 1."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


class _Groups:
    tp = _OneRank()
    cp = _OneRank()


def _config(heads: int = 4, groups: int = 2, head_dim: int = 8, **kw: object) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0, **kw)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Dense attention in float64, one (batch, head) at a time: q [s, b, np, hn], k/v [s, b, ng, hn],
    masked [s, s] or [b, s, s] True = masked; output [s, b, np*hn]."""
    s, b, heads, hn = q.shape
    per_group = heads // k.shape[2]
    out = torch.zeros(s, b, heads, hn, dtype=torch.float64)
    for bi in range(b):
        m = masked if masked.dim() == 2 else masked[bi]
        for h in range(heads):
            g = h // per_group  # query head h reads key/value group h // (heads / groups)
            scores = q[:, bi, h].double() @ k[:, bi, g].double().T / math.sqrt(hn)
            scores = scores.masked_fill(m, float("-inf"))
            out[:, bi, h] = torch.softmax(scores, dim=-1) @ v[:, bi, g].double()
    return out.reshape(s, b, heads * hn)


def _inputs(s: int, b: int, heads: int = 4, groups: int = 2, hn: int = 8) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, heads, hn, generator=gen, dtype=torch.float64)
    k = torch.randn(s, b, groups, hn, generator=gen, dtype=torch.float64)
    v = torch.randn(s, b, groups, hn, generator=gen, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
def test_causal_attention_equals_dense_float64(heads: int, groups: int) -> None:
    attn = LocalAttention(_config(heads, groups), 1, AttnMaskType.causal, "self", pg_collection=_Groups())
    q, k, v = _inputs(7, 3, heads, groups)
    got = attn(q, k, v, None)
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
    assert got.shape == (7, 3, heads * 8)
    assert (got - _reference(q, k, v, causal)).abs().max() < 1e-12


def test_packed_rows_mask_keeps_rows_apart() -> None:
    # Three rows of 3, 1 and 4 tokens packed into one row of 8: block-diagonal causal mask.
    rows = CompactRows(torch.arange(1, 13).reshape(3, 4), torch.tensor([1, 1, 2]), torch.tensor([3, 1, 4]), 2)
    mask = pack_rows(rows).attention_mask  # (1, 1, 8, 8) True = masked
    attn = LocalAttention(_config(), 1, AttnMaskType.causal, "self", pg_collection=_Groups())
    q, k, v = _inputs(8, 1)
    got = attn(q, k, v, mask)
    assert (got - _reference(q, k, v, mask[0, 0])).abs().max() < 1e-12
    # The second row (position 3) sees only itself: its output is its own value vector.
    assert torch.allclose(got[3, 0].view(4, 8)[0], v[3, 0, 0], atol=1e-12)


def test_float32_matches_float64_within_its_rounding() -> None:
    # fp32 softmax-weighted sums of O(1) values over 16 keys: error a few ulps of the largest term.
    attn = LocalAttention(_config(), 1, AttnMaskType.causal, "self", pg_collection=_Groups())
    q, k, v = _inputs(16, 2)
    got = attn(q.float(), k.float(), v.float(), None).double()
    want = _reference(q, k, v, torch.ones(16, 16, dtype=torch.bool).triu(1))
    bound = 64 * torch.finfo(torch.float32).eps * v.abs().max().item()
    assert (got - want).abs().max() < bound


def test_spec_rewrite_replaces_dot_product_attention() -> None:
    spec = get_gpt_layer_local_spec()
    swapped = with_local_attention(spec, _config())
    assert swapped.submodules.self_attention.submodules.core_attention is LocalAttention
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention  # a copy


def test_sliding_window_keeps_megatron_attention_at_cp1_and_is_refused_at_cp2() -> None:
    spec = get_gpt_layer_local_spec()
    windowed = _config(window_size=(4, 0))
    kept = with_local_attention(spec, windowed)
    assert kept.submodules.self_attention.submodules.core_attention is DotProductAttention
    windowed.context_parallel_size = 2
    with pytest.raises(ConfigError, match="sliding-window attention .* context_parallel_size=1"):
        with_local_attention(spec, windowed)
    with pytest.raises(ConfigError, match="sliding-window"):
        LocalAttention(_config(window_size=(4, 0)), 1, AttnMaskType.causal, "self", pg_collection=_Groups())


def test_cp_without_dot_product_attention_is_refused() -> None:
    config = _config()
    config.context_parallel_size = 2
    with pytest.raises(ConfigError, match="context_parallel_size=1"):
        with_local_attention(ModuleSpec(module=torch.nn.Identity), config)
