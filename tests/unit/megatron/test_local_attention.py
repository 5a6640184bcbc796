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
from megarl.megatron.attention import (
    HALF_PRECISION_EXPLICIT_MAX_KEYS, LocalAttention, explicit_attention, prefers_explicit_attention,
    with_local_attention,
)
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


FLASH_BACKWARD = "ScaledDotProductFlashAttentionForCpuBackward0"


def _graph_nodes(t: torch.Tensor) -> set[str]:
    """The names of the autograd nodes `t` was computed by."""
    names, todo, seen = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def _dense_float64_with_error_scales(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     masked: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    """Dense causal attention in float64 and its gradients for the upstream gradient `g`, worked out
    by hand (q [s, b, np, hn], k/v [s, b, ng, hn], g [s, b, np*hn], masked [s, s] True = masked).

    Returns the values (out, q, k, v gradients, in the inputs' layouts), the same sums taken over
    the absolute value of every term (what rounding each term by a relative u can move a result
    by), and the largest |score|."""
    s, b, heads, hn = q.shape
    per_group = heads // k.shape[2]
    scale = 1.0 / math.sqrt(hn)
    Q = q.double().permute(1, 2, 0, 3)  # [b, np, s, hn]
    K = k.double().permute(1, 2, 0, 3).repeat_interleave(per_group, dim=1)  # each query head's group
    V = v.double().permute(1, 2, 0, 3).repeat_interleave(per_group, dim=1)
    G = g.double().view(s, b, heads, hn).permute(1, 2, 0, 3)
    S = (Q @ K.transpose(-1, -2)) * scale
    P = torch.softmax(S.masked_fill(masked, float("-inf")), dim=-1)
    dP = G @ V.transpose(-1, -2)
    dS = P * (dP - (P * dP).sum(-1, keepdim=True))
    dP_abs = G.abs() @ V.abs().transpose(-1, -2)
    dS_abs = P * (dP_abs + (P * dP_abs).sum(-1, keepdim=True))

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [b, np, s, hn] -> [s, b, ng, hn], summed over each group
        return t.view(b, heads // per_group, per_group, s, hn).sum(2).permute(2, 0, 1, 3)

    def layout(t: torch.Tensor) -> torch.Tensor:  # [b, np, s, hn] -> [s, b, np, hn]
        return t.permute(2, 0, 1, 3)

    values = {"out": layout(P @ V).reshape(s, b, heads * hn), "q": layout(scale * dS @ K),
              "k": grouped(scale * dS.transpose(-1, -2) @ Q), "v": grouped(P.transpose(-1, -2) @ G)}
    scales = {"out": layout(P @ V.abs()).reshape(s, b, heads * hn), "q": layout(scale * dS_abs @ K.abs()),
              "k": grouped(scale * dS_abs.transpose(-1, -2) @ Q.abs()), "v": grouped(P.transpose(-1, -2) @ G.abs())}
    return values, scales, float(S.masked_fill(masked, 0.0).abs().max())


def _masks(s: int, b: int, heads: int) -> dict[str, torch.Tensor | None]:
    """Masks LocalAttention is called with (True = masked), each letting every query see itself:
    none (causal), one per row (left padding + causal, as a prompt-sharing or padded batch), and
    one per row and head."""
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    pad = torch.tensor([0, 3, 5])[:b]
    hides_key = torch.arange(s)[None, :] < pad[:, None]  # [b, s]: row r's first pad[r] keys
    per_row = (causal[None] | hides_key[:, None, :]) & ~torch.eye(s, dtype=torch.bool)[None]
    per_head = per_row[:, None].repeat(1, heads, 1, 1)
    per_head[:, 1, :, 0] = True  # head 1 never sees key 0 ...
    per_head[:, 1, 0, 0] = False  # ... except from query 0, which sees only it
    return {"causal": None, "per_row": per_row[:, None], "per_head": per_head}


@pytest.mark.parametrize("mask", ["causal", "per_row", "per_head"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_training_rows_match_float64_within_their_rounding(dtype: torch.dtype, mask: str) -> None:
    # Short rows of a half-precision CPU training step go to `explicit_attention`
    # (`prefers_explicit_attention`). Inputs are exact in `dtype`; every rounding on the way (scores,
    # probabilities, products, the output) is relative u = eps/2 of its term, and a score rounded by
    # u|S| moves its probability by a relative 2u*max|S|: each result is off by at most
    # u * (2 max|S| + 6) times the sum of its terms' absolute values.
    attn = LocalAttention(_config(heads=4, groups=2), 1, AttnMaskType.causal, "self", pg_collection=_Groups())
    q, k, v = (t.to(dtype) for t in _inputs(12, 3))
    g = torch.randn(12, 3, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    masked = _masks(12, 3, 4)[mask]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attn(*leaves, masked)
    out.backward(g)
    nodes = _graph_nodes(out)
    assert FLASH_BACKWARD not in nodes and "MaskedFillBackward0" in nodes  # explicit attention ran
    reference_mask = torch.ones(12, 12, dtype=torch.bool).triu(1) if masked is None else masked
    want, scales, max_score = _dense_float64_with_error_scales(q, k, v, g, reference_mask)
    u = torch.finfo(dtype).eps / 2
    for name, got in zip(("out", "q", "k", "v"), (out, *(t.grad for t in leaves))):
        err = (got.double() - want[name]).abs()
        assert bool((err <= u * (2 * max_score + 6) * scales[name]).all()), (name, float(err.max()))


def test_explicit_attention_dropout_zeroes_probabilities_and_rescales_the_rest() -> None:
    # With one-hot values (key j's value is unit vector j) the output row is the dropped-out
    # probability row itself: each entry is 0 or p_j / (1 - p).
    s, b, heads, p = 8, 3, 4, 0.5
    q, k, _ = (t.to(torch.bfloat16) for t in _inputs(s, b, heads=heads, groups=2, hn=s))
    v = torch.eye(s, dtype=torch.bfloat16)[:, None, None, :].expand(s, b, 2, s)
    masked = torch.ones(s, s, dtype=torch.bool).triu(1)
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    torch.manual_seed(3)
    got = explicit_attention(qh.requires_grad_(), kh, vh, masked, 1.0 / math.sqrt(s), dropout_p=p).detach().double()
    scores = qh.double() @ kh.double().repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(s)
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
    kept = got != 0
    visible = ~masked.expand_as(kept)
    share_dropped = 1 - kept[visible].double().mean()
    assert 0.4 < share_dropped < 0.6  # 1,152 visible entries: p = 0.5 +- 3.4 standard deviations
    assert not bool(kept[~visible].any())
    # fp32 arithmetic, then one bf16 rounding (relative 2^-9) of the output: within 2^-8 relative.
    rel = (got[kept] - probs[kept] / (1 - p)).abs() / (probs[kept] / (1 - p))
    assert float(rel.max()) <= 2.0 ** -8


def test_explicit_attention_only_for_short_half_precision_training_rows() -> None:
    def query(dtype: torch.dtype, grad: bool = True) -> torch.Tensor:
        return torch.zeros(1, 1, 1, 8, dtype=dtype, requires_grad=grad)

    assert prefers_explicit_attention(query(torch.bfloat16), HALF_PRECISION_EXPLICIT_MAX_KEYS)
    assert prefers_explicit_attention(query(torch.float16), 1)
    assert not prefers_explicit_attention(query(torch.bfloat16), HALF_PRECISION_EXPLICIT_MAX_KEYS + 1)
    assert not prefers_explicit_attention(query(torch.float32), 8)  # fp32: the flash kernel
    assert not prefers_explicit_attention(query(torch.bfloat16, grad=False), 8)  # log-prob passes
    with torch.no_grad():
        assert not prefers_explicit_attention(query(torch.bfloat16), 8)
    # A long half-precision row keeps the flash kernel (its backward is the flash one).
    attn = LocalAttention(_config(), 1, AttnMaskType.causal, "self", pg_collection=_Groups())
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in _inputs(HALF_PRECISION_EXPLICIT_MAX_KEYS + 1, 1))
    assert FLASH_BACKWARD in _graph_nodes(attn(q, k, v, None))


def test_causal_masks_of_only_the_last_few_lengths_are_kept() -> None:
    """The causal mask of each query length is built once and reused while it is among the last
    `CAUSAL_MASKS_KEPT` used; a run meeting a new length at every micro-batch does not keep them all
    (it held one per length seen: 2.7 GiB per layer for the lengths up to 4,096 at cp = 2)."""
    from megarl.megatron.attention import CAUSAL_MASKS_KEPT

    attn = LocalAttention(_config(), 1, AttnMaskType.causal, "self", pg_collection=_Groups())
    cpu = torch.device("cpu")
    first = attn._causal_mask(5, cpu)
    assert torch.equal(first, torch.ones(5, 5, dtype=torch.bool).triu(1))  # True above the diagonal: masked
    assert attn._causal_mask(5, cpu) is first  # reused
    for sq in range(6, 200):
        attn._causal_mask(sq, cpu)
    assert len(attn._masks) == CAUSAL_MASKS_KEPT
    assert [sq for sq, _ in attn._masks] == list(range(200 - CAUSAL_MASKS_KEPT, 200))
    attn._causal_mask(200 - CAUSAL_MASKS_KEPT, cpu)  # a use makes a length the most recent
    attn._causal_mask(7, cpu)
    assert [sq for sq, _ in attn._masks][-2:] == [200 - CAUSAL_MASKS_KEPT, 7]
    assert torch.equal(attn._causal_mask(7, cpu), torch.ones(7, 7, dtype=torch.bool).triu(1))
