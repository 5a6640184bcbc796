"""The weight-sync fingerprint: every single-bit change of a span's bytes changes it (also in the
bytes before the first and after the last aligned word), it adds up over parts cut anywhere, and
the fused copy moves exactly the bytes and fingerprints the bucket span in both directions."""

from __future__ import annotations

import pytest
import torch

from megarl.hybrid.verify import copy_and_fingerprint, fingerprint

pytestmark = pytest.mark.unit


def test_every_single_bit_flip_changes_the_fingerprint() -> None:
    storage = torch.arange(64, dtype=torch.uint8) * 37
    span = storage[3:40]  # starts 3 bytes into a word, ends 0 bytes into one: head, words and tail
    base = int(fingerprint(span))
    for i in range(span.numel()):
        for bit in range(8):
            damaged = storage.clone()
            damaged[3 + i] ^= 1 << bit
            assert int(fingerprint(damaged[3:40])) != base, (i, bit)


def test_parts_add_up_to_the_whole() -> None:
    span = torch.randn(1000, dtype=torch.float64).view(torch.uint8)[5:7001]
    whole = int(fingerprint(span))
    for cut in (1, 3, 8, 13, 4096, 6995):
        parts = fingerprint(span[:cut]) + fingerprint(span[cut:])
        assert int(parts) == whole, cut


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contiguous", [True, False])
def test_fused_copy_moves_the_bytes_and_fingerprints_the_span(dtype: torch.dtype, contiguous: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(700, 96, generator=gen).to(dtype)
    other = full[100:600] if contiguous else full[:, 16:80]  # an axis-0 or an axis-1 slice
    n = other.numel()
    buffer = torch.zeros(n + 3, dtype=dtype)
    span = buffer[3:3 + n]  # not aligned to a word
    fp = copy_and_fingerprint(span, other, span_is_src=False)  # pack: slice -> bucket
    assert torch.equal(span.view(other.shape), other)
    assert int(fp) == int(fingerprint(span))  # block by block == in one pass
    target = torch.zeros_like(full)
    dst = target[100:600] if contiguous else target[:, 16:80]
    assert int(copy_and_fingerprint(span, dst, span_is_src=True)) == int(fp)  # unpack: bucket -> slice
    assert torch.equal(dst, other)
