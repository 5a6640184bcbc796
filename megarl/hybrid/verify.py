"""Did every rollout rank receive the bytes its senders sent? Weight-sync verification.

Every piece of every bucket (one slice of one tensor) is fingerprinted twice: by its sender right
after packing it into the flat send buffer, and by its receiver right before unpacking it from the
flat receive buffer, each while those bytes are still in the cache of the copy that touches them.
After the sync one all-reduce of two int64 vectors (one entry per piece of the plan, each filled by
exactly one sender and one receiver) gives every rank every fingerprint, so all ranks see the same
mismatches and stop together, with the tensor, slice and ranks of each piece that arrived changed.

The fingerprint of a piece is the wrapping sum of its raw bytes read as 64-bit words (linear, so
it can be summed in blocks cut anywhere): each block of about `FINGERPRINT_BLOCK_BYTES` is summed
right after it is copied (sender) or right before (receiver), while it is in cache. No extra copy,
on CPU and GPU. Any change confined to one word (a flipped bit,
a zeroed or torn word) changes it; a truncated or zero-filled piece does unless its bytes summed to
zero. It is a transport check, not a cryptographic one.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from megarl.errors import MegarlError
from megarl.hybrid.plan import Piece, ReshardPlan

BucketKey = tuple[int, tuple[int, int]]  # (step, (sender, receiver))
PieceKey = tuple[int, tuple[int, int], int]  # (step, (sender, receiver), index of the piece in its bucket)
FINGERPRINT_BLOCK_BYTES = 2 * 2**20  # about a core's cache


class WeightSyncError(MegarlError, RuntimeError):
    """The rollout engine did not receive the weights the trainer sent. Names tensor, slice and ranks."""


def fingerprint(span: torch.Tensor) -> torch.Tensor:
    """int64 scalar on `span`'s device: the wrapping sum of the 64-bit little-endian words of the
    contiguous 1-D `span`'s storage, each word counting only the bytes inside `span`.

    Linear in the bytes and aligned to the storage, so the fingerprints of consecutive parts of a
    span add up (wrapping) to the span's: blocks may be cut anywhere."""
    raw = span.view(torch.uint8)
    offset = raw.storage_offset()  # storages are allocated 8-byte aligned
    head = min((-offset) % 8, raw.numel())
    n = (raw.numel() - head) // 8 * 8
    total = raw[head:head + n].view(torch.int64).sum() if n else torch.zeros((), dtype=torch.int64, device=span.device)
    for lo, hi in ((0, head), (head + n, raw.numel())):
        if hi > lo:  # bytes of words cut by the span's ends, each shifted to its place in its word
            shifts = (torch.arange(offset + lo, offset + hi, device=span.device) % 8) * 8
            total = total + (raw[lo:hi].to(torch.int64) << shifts).sum()
    return total


def block_elements(dtype: torch.dtype) -> int:
    """Elements of one fingerprint block in `dtype`."""
    return FINGERPRINT_BLOCK_BYTES // torch.empty((), dtype=dtype).element_size()


def copy_and_fingerprint(span: torch.Tensor, other: torch.Tensor, span_is_src: bool) -> torch.Tensor:
    """Copy between the flat 1-D bucket span `span` and the tensor slice `other` (as many elements;
    `span` holds them in `other`'s row-major order), `span` -> `other` if `span_is_src`, else
    `other` -> `span`; returns the fingerprint of `span`, summed block by block while each block
    is in cache (blocks of whole leading-dimension rows of `other`)."""
    view = other if other.dim() else other.reshape(1)
    rows = view.shape[0]
    row_numel = span.numel() // rows if rows else 0
    per_block = max(1, block_elements(span.dtype) // max(row_numel, 1))
    parts = []
    for r in range(0, rows, per_block):
        part = span[r * row_numel:min(rows, r + per_block) * row_numel]
        rows_part = view[r:r + per_block]
        if span_is_src:
            parts.append(fingerprint(part))
            rows_part.copy_(part.view(rows_part.shape))
        else:
            part.view(rows_part.shape).copy_(rows_part)
            parts.append(fingerprint(part))
    if not parts:
        return torch.zeros((), dtype=torch.int64, device=span.device)
    return torch.stack(parts).sum() if len(parts) > 1 else parts[0]


def piece_keys(plan: ReshardPlan) -> list[PieceKey]:
    """Every piece the plan exchanges, in the order of the fingerprint vectors."""
    return [(k, pair, i) for k, step in enumerate(plan.steps) for pair, pieces in step.items()
            for i in range(len(pieces))]


def _describe(p: Piece) -> str:
    return (f"{p.src_name!r} [axis {p.axis}, {p.src_start}:{p.src_start + p.length}] of rank {p.src} -> "
            f"{p.dst_name!r} [axis {p.axis}, {p.dst_start}:{p.dst_start + p.length}] of rank {p.dst}")


def check_pieces(plan: ReshardPlan, sent: Mapping[BucketKey, list[torch.Tensor]],
                 received: Mapping[BucketKey, list[torch.Tensor]],
                 all_reduce: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> int:
    """Compare the fingerprints every sender and receiver took (per bucket, one per piece in the
    plan's order); raise `WeightSyncError` naming each changed piece. `all_reduce` sums a tensor over the ranks of the sync (identity within one
    process). Collective: every rank calls it after the same sync. Returns the pieces checked."""
    keys = piece_keys(plan)
    index = {key: i for i, key in enumerate(keys)}
    both = torch.zeros(2, len(keys), dtype=torch.int64, device=device)
    for row, by_bucket in ((0, sent), (1, received)):
        positions = [index[(k, pair, i)] for (k, pair), fps in by_bucket.items() for i in range(len(fps))]
        if positions:
            values = torch.stack([fp for fps in by_bucket.values() for fp in fps])
            both[row].index_put_((torch.tensor(positions, device=device),), values)
    both = all_reduce(both)
    bad = [keys[i] for i in (both[0] != both[1]).nonzero().flatten().tolist()]
    if not bad:
        return len(keys)
    buckets = sorted({(k, pair) for k, pair, _ in bad})
    named = [_describe(plan.steps[k][pair][i]) for k, pair, i in bad]
    where = "; ".join(f"step {k}, rank {src} -> rank {dst}" for k, (src, dst) in buckets[:4])
    raise WeightSyncError(
        f"weight sync verification failed: {len(bad)} of {len(keys)} pieces in {len(buckets)} bucket(s) arrived "
        f"changed ({where}); slices that differ: {'; '.join(named[:6])}{' ...' if len(named) > 6 else ''}. "
        "The rollout engine does not hold the trained weights; stopping."
    )
