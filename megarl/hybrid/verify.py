"""Did every rollout rank receive the bytes its senders sent? Weight-sync verification.

Each bucket of a reshard step is fingerprinted twice: by its sender right after packing, and by its
receiver right after the transfer, before unpacking. After the sync one all-reduce of two int64
vectors (one entry per bucket of the plan, each filled by exactly one sender and one receiver)
gives every rank every fingerprint, so all ranks see the same mismatches and stop together.
Only when a bucket differs are its pieces fingerprinted one by one (the sender's source slices,
the receiver's engine slices) to name the tensor and slice that arrived changed.

The fingerprint is the wrapping sum of the buffer's raw bytes read as 64-bit words: one pass at
memory bandwidth on CPU and GPU, no copy. Any change confined to one word (a flipped bit, a
zeroed or torn word) changes it; a truncated or zero-filled bucket does unless its bytes sum to
zero. It is a transport check, not a cryptographic one.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from megarl.errors import MegarlError
from megarl.hybrid.plan import Piece, ReshardPlan

Pair = tuple[int, int]
BucketKey = tuple[int, Pair]  # (step, (sender, receiver))


class WeightSyncError(MegarlError, RuntimeError):
    """The rollout engine did not receive the weights the trainer sent. Names tensor, slice and ranks."""


def fingerprint(buf: torch.Tensor) -> torch.Tensor:
    """int64 scalar on `buf`'s device: wrapping sum of the raw bytes of contiguous `buf` as
    little-endian 64-bit words (the last < 8 bytes weighted by their position)."""
    raw = buf.reshape(-1).view(torch.uint8)
    n = raw.numel() // 8 * 8
    total = raw[:n].view(torch.int64).sum() if n else torch.zeros((), dtype=torch.int64, device=buf.device)
    if n < raw.numel():
        tail = raw[n:].to(torch.int64)
        total = total + (tail << (8 * torch.arange(tail.numel(), device=buf.device))).sum()
    return total


def bucket_keys(plan: ReshardPlan) -> list[BucketKey]:
    """Every bucket of the plan, in the order of the fingerprint vectors."""
    return [(k, pair) for k, step in enumerate(plan.steps) for pair in step]


def _slice(t: torch.Tensor, axis: int, start: int, length: int) -> torch.Tensor:
    return t.narrow(axis, start, length)


def _describe(p: Piece) -> str:
    return (f"{p.src_name!r} [axis {p.axis}, {p.src_start}:{p.src_start + p.length}] of rank {p.src} -> "
            f"{p.dst_name!r} [axis {p.axis}, {p.dst_start}:{p.dst_start + p.length}] of rank {p.dst}")


def check_buckets(plan: ReshardPlan, sent: Mapping[BucketKey, torch.Tensor], received: Mapping[BucketKey, torch.Tensor],
                  shards_by_rank: Mapping[int, Mapping[str, torch.Tensor]],
                  targets_by_rank: Mapping[int, Mapping[str, torch.Tensor]],
                  all_reduce: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> int:
    """Compare the fingerprints every sender and receiver took; raise `WeightSyncError` naming each
    changed piece. `all_reduce` sums a tensor over the ranks of the sync (identity within one
    process). Collective: every rank calls it after the same sync. Returns the buckets checked."""
    keys = bucket_keys(plan)
    both = torch.zeros(2, len(keys), dtype=torch.int64, device=device)
    for i, key in enumerate(keys):
        if key in sent:
            both[0, i] = sent[key]
        if key in received:
            both[1, i] = received[key]
    both = all_reduce(both)
    bad = [keys[i] for i in (both[0] != both[1]).nonzero().flatten().tolist()]
    if not bad:
        return len(keys)
    # Localise: per piece, the sender's source slice against the receiver's engine slice.
    pieces = [(key, p) for key in bad for p in plan.steps[key[0]][key[1]]]
    per_piece = torch.zeros(2, len(pieces), dtype=torch.int64, device=device)
    for j, ((_, (src, dst)), p) in enumerate(pieces):
        if src in shards_by_rank:
            per_piece[0, j] = fingerprint(_slice(shards_by_rank[src][p.src_name], p.axis, p.src_start, p.length)
                                          .contiguous())
        if dst in targets_by_rank:
            got = _slice(targets_by_rank[dst][p.dst_name], p.axis, p.dst_start, p.length)
            per_piece[1, j] = fingerprint(got.to(plan.dtype).contiguous())
    per_piece = all_reduce(per_piece)
    changed = [p for j, (_, p) in enumerate(pieces) if per_piece[0, j] != per_piece[1, j]]
    lines = [f"step {k}, rank {src} -> rank {dst}: sender fingerprint {int(both[0, keys.index((k, (src, dst)))])}, "
             f"received {int(both[1, keys.index((k, (src, dst)))])}" for k, (src, dst) in bad]
    named = [_describe(p) for p in changed] or [f"(no single slice differs; pieces in the bucket: "
                                                 f"{', '.join(_describe(p) for _, p in pieces[:3])})"]
    raise WeightSyncError(
        f"weight sync verification failed: {len(bad)} of {len(keys)} buckets arrived changed "
        f"({'; '.join(lines[:4])}); slices that differ: {'; '.join(named[:6])}"
        f"{' ...' if len(named) > 6 else ''}. The rollout engine does not hold the trained weights; stopping."
    )
