"""The foreach multi-tensor ops that replace Megatron's per-tensor fallbacks (no apex, no TE):
the gradient norm against a float64 sum of squares, the scale bit for bit against Megatron's own
loop, and the swap itself (only Megatron's fallbacks are replaced, once)."""

from __future__ import annotations

import pytest
import torch

from megarl.megatron.cpu_compat import apply_cpu_compat
from megarl.megatron.optim import foreach_l2_norm, foreach_scale, use_foreach_multi_tensor_ops

pytestmark = pytest.mark.unit


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * scale for shape, scale in
            (((256, 768), 1e-3), ((768,), 10.0), ((17, 256), 1.0), ((1,), 5.0), ((0,), 1.0))]


def test_norm_equals_the_float64_norm_of_all_tensors():
    from megatron.core.utils import local_multi_tensor_l2_norm

    apply_cpu_compat()  # Megatron's fallback puts its result on "cuda"
    tensors = _tensors(0)
    flag = torch.zeros(1, dtype=torch.int)
    got, _ = foreach_l2_norm(2048 * 32, flag, [tensors], False)
    want = sum(float((t.double() ** 2).sum()) for t in tensors) ** 0.5
    # float32 sums of n terms: relative error at most about n * eps (n = largest tensor's size)
    n = max(t.numel() for t in tensors)
    assert got.shape == (1,) and got.dtype == torch.float32
    assert abs(float(got) - want) <= n * torch.finfo(torch.float32).eps * want
    mega, _ = local_multi_tensor_l2_norm(2048 * 32, flag, [tensors], False)
    assert abs(float(got) - float(mega)) <= n * torch.finfo(torch.float32).eps * want
    empty, _ = foreach_l2_norm(2048 * 32, flag, [[]], False)
    assert float(empty) == 0.0


def test_scale_is_megatrons_scale_bit_for_bit():
    from megatron.core.utils import local_multi_tensor_scale

    flag = torch.zeros(1, dtype=torch.int)
    for in_place in (True, False):
        src = _tensors(1)
        dst = src if in_place else [torch.empty_like(t) for t in src]
        want = [t.clone() for t in src]
        local_multi_tensor_scale(0, flag, [want, want], 0.37)
        foreach_scale(0, flag, [src, dst], 0.37)
        for a, b in zip(dst, want):
            assert torch.equal(a, b)
    # The fp16 optimizer's copy of fp32 main parameters into bf16 model parameters (scale 1.0).
    src = _tensors(2)
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    want = [torch.empty_like(t) for t in dst]
    local_multi_tensor_scale(0, flag, [src, want], 1.0)
    foreach_scale(0, flag, [src, dst], 1.0)
    for a, b in zip(dst, want):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_only_megatrons_fallbacks_are_swapped(monkeypatch):
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    fused = object()  # stands for an apex / TransformerEngine kernel
    monkeypatch.setattr(clip_grads, "l2_norm_impl", mcore_utils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", mcore_utils.local_multi_tensor_scale)
    monkeypatch.setattr(mcore_optimizer, "multi_tensor_scale_impl", fused)
    use_foreach_multi_tensor_ops()
    use_foreach_multi_tensor_ops()
    assert clip_grads.l2_norm_impl is foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is foreach_scale
    assert mcore_optimizer.multi_tensor_scale_impl is fused
