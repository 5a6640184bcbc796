"""Did every rollout rank receive the bytes its senders sent? Weight-sync verification.

Every piece of every bucket (one slice of one tensor) is fingerprinted twice: by its sender right
after packing it into the flat send buffer, and by its receiver right before unpacking it from the
flat receive buffer, each while those bytes are still in the cache of the copy that touches them.
After the transfers each sender sends each of its receivers one int64 vector, the fingerprints of
the pieces it sent that receiver in the plan's order, and the receiver compares them with its own:
point-to-point, along the pairs the rank already exchanges with, so a rank's cost depends on its
own pieces and not on the world size (a rank's own plan suffices). One all-reduce of two counters
(pieces compared, pieces that differ) then tells every rank the outcome, so all ranks stop
together; only then, on a mismatch, the receivers' descriptions of the changed pieces are gathered
so that every rank raises the same error, naming the tensor, slice and ranks of each.

The fingerprint of a piece is the wrapping sum of its raw bytes read as 64-bit words (linear, so
it can be summed in blocks cut anywhere): each block of about `FINGERPRINT_BLOCK_BYTES` is summed
right after it is copied (sender) or right before (receiver), while it is in cache. No extra copy,
on CPU and GPU. Any change confined to one word (a flipped bit,
a zeroed or torn word) changes it; a truncated or zero-filled piece does unless its bytes summed to
zero. It is a transport check, not a cryptographic one.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Protocol

import torch

from megarl.errors import MegarlError
from megarl.hybrid.plan import Piece, ReshardPlan

Pair = tuple[int, int]  # (sender, receiver)
BucketKey = tuple[int, Pair]  # (step, (sender, receiver))
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


class FingerprintTransport(Protocol):
    """What the check needs of the sync's transport (`megarl.hybrid.executor.Transport`)."""

    def start(self, sends: dict[Pair, torch.Tensor], recvs: dict[Pair, torch.Tensor]) -> Any: ...

    def wait(self, handle: Any) -> None: ...

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...


def pair_pieces(plan: ReshardPlan, ranks: Iterable[int]) -> dict[Pair, list[tuple[int, int]]]:
    """(step, index in its bucket) of every piece each pair with an end in `ranks` exchanges, in
    the order of that pair's fingerprint vector (step, then position in the bucket)."""
    mine = set(ranks)
    out: dict[Pair, list[tuple[int, int]]] = {}
    for k, step in enumerate(plan.steps):
        for pair, pieces in step.items():
            if pair[0] in mine or pair[1] in mine:
                out.setdefault(pair, []).extend((k, i) for i in range(len(pieces)))
    return out


def _describe(p: Piece) -> str:
    return (f"{p.src_name!r} [axis {p.axis}, {p.src_start}:{p.src_start + p.length}] of rank {p.src} -> "
            f"{p.dst_name!r} [axis {p.axis}, {p.dst_start}:{p.dst_start + p.length}] of rank {p.dst}")


def _vector(fps: Mapping[BucketKey, list[torch.Tensor]], pair: Pair, keys: list[tuple[int, int]]) -> torch.Tensor:
    """One pair's fingerprints, in the order of `keys` (every bucket's list is in piece order)."""
    steps = list(dict.fromkeys(k for k, _ in keys))
    return torch.stack([fp for k in steps for fp in fps[(k, pair)]])


def check_pieces(plan: ReshardPlan, ranks: Iterable[int], sent: Mapping[BucketKey, list[torch.Tensor]],
                 received: Mapping[BucketKey, list[torch.Tensor]], transport: FingerprintTransport,
                 device: torch.device) -> int:
    """Compare the fingerprints the senders and receivers among `ranks` (the ranks of this
    process) took, per bucket one per piece in the plan's order; raise `WeightSyncError` naming
    each changed piece. Collective: every rank of the sync calls it after the same sync.

    Cost per rank: one int64 per piece it sends or receives, point-to-point, and one all-reduce
    of two int64; on a mismatch also one gather of the descriptions. Returns the pieces checked
    in the whole world (the same number on every rank)."""
    ranks = set(ranks)
    order = pair_pieces(plan, ranks)
    sends = {pair: _vector(sent, pair, keys) for pair, keys in order.items() if pair[0] in ranks}
    recvs = {pair: torch.empty(len(keys), dtype=torch.int64, device=device)
             for pair, keys in order.items() if pair[1] in ranks}
    transport.wait(transport.start(sends, recvs))
    checked, bad = 0, []
    for pair, theirs in recvs.items():
        keys = order[pair]
        ours = _vector(received, pair, keys).to(device)
        checked += len(keys)
        for j in (ours != theirs).nonzero().flatten().tolist():
            k, i = keys[j]
            bad.append((k, pair, i, _describe(plan.steps[k][pair][i])))
    counts = transport.all_reduce(torch.tensor([checked, len(bad)], dtype=torch.int64, device=device))
    total, n_bad = (int(x) for x in counts.tolist())
    if n_bad == 0:
        return total
    bad = sorted(entry for part in transport.all_gather_object(bad) for entry in part)
    buckets = sorted({(k, pair) for k, pair, _, _ in bad})
    named = [text for _, _, _, text in bad]
    where = "; ".join(f"step {k}, rank {src} -> rank {dst}" for k, (src, dst) in buckets[:4])
    raise WeightSyncError(
        f"weight sync verification failed: {len(bad)} of {total} pieces in {len(buckets)} bucket(s) arrived "
        f"changed ({where}); slices that differ: {'; '.join(named[:6])}{' ...' if len(named) > 6 else ''}. "
        "The rollout engine does not hold the trained weights; stopping."
    )
