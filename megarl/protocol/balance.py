"""Balanced partitions of sequences by their token counts (verl's `trainer.balance_batch`).

Two uses, both pure functions:
- data-parallel balance: the driver reorders a batch's rows so that each of the `dp` contiguous
  shards `call_dp` hands out holds about the same number of real tokens (`balance_order`);
- micro-batch balance: a rank splits its rows into micro-batches of about equal tokens
  (`megarl.megatron.packing.plan_micro_batches` with a token budget and packing).

The partition is Karmarkar-Karp's largest differencing method for k parts: every item starts as a
k-way state (one part holds the item, the others nothing), and the two states with the largest
spread (largest minus smallest part sum) are merged, largest part of one with smallest of the
other, until one state remains. With `equal_size` the initial states are groups of k consecutive
items of the sorted list, one item per part, so every part ends with n / k items. Merging two states
of spreads a and b gives a spread of at most max(a, b), hence the final spread (max - min part
sum) is at most max(lengths) - min(lengths) (equal_size) or max(lengths) (otherwise).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from megarl.errors import ConfigError


def balanced_partition(lengths: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of `lengths` in k parts of about equal sum, each part sorted ascending.

    lengths: n non-negative token counts. equal_size: every part gets n / k items (n must be a
    multiple of k). Parts are ordered by descending sum. Deterministic: ties break by index.
    """
    n = len(lengths)
    if k < 1:
        raise ConfigError(f"balanced_partition: k = {k}, must be >= 1")
    if equal_size and n % k:
        raise ConfigError(f"balanced_partition: {n} items cannot form {k} parts of equal size")
    order = sorted(range(n), key=lambda i: (int(lengths[i]), i))
    # State: (parts as (sum, item indices)) sorted by descending sum; heap key: -spread.
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    if equal_size:
        groups = [order[i:i + k] for i in range(0, n, k)]
    else:
        groups = [[i] for i in order]
    for tie, group in enumerate(groups):
        parts = [(int(lengths[i]), [i]) for i in group] + [(0, []) for _ in range(k - len(group))]
        parts.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), tie, parts))
    tie = len(groups)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]) for i in range(k)]
        merged.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(items) for _, items in heap[0][2]]


def seqlen_metrics(per_rank_before: Sequence[int], per_rank_after: Sequence[int]) -> dict[str, float]:
    """verl's `global_seqlen/*`: tokens per DP rank before (min, max, minmax_diff) and after
    (balanced_min, balanced_max) balancing, and their mean."""
    before, after = np.asarray(per_rank_before), np.asarray(per_rank_after)
    return {"global_seqlen/min": float(before.min()), "global_seqlen/max": float(before.max()),
            "global_seqlen/minmax_diff": float(before.max() - before.min()),
            "global_seqlen/balanced_min": float(after.min()), "global_seqlen/balanced_max": float(after.max()),
            "global_seqlen/mean": float(before.mean())}


# How much larger the largest shard may get when whole groups are balanced instead of single rows.
GROUP_BALANCE_SLACK = 0.05


def balance_order(attention_mask: torch.Tensor, dp: int,
                  groups: Sequence[Hashable] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Row order that gives each of `dp` contiguous equal shards about the same number of tokens.

    attention_mask: (B, T), 1 on real tokens (prompt + response). Returns (order (B,) int64, metrics):
    `batch[order]` is the balanced batch; shard d is rows d*B/dp .. (d+1)*B/dp - 1 of it.
    B must be a multiple of dp (the dispatch pads otherwise; see `balance_applies`).

    groups: a group id per row (the uid of the prompt a response answers). When every group has the
    same number of rows and the groups divide evenly over the shards, whole groups are balanced,
    each group's rows kept together in one shard, next to each other (the engine then computes
    their shared prompt once: `model.prompt_sharing`), unless that leaves the largest shard more
    than `GROUP_BALANCE_SLACK` above the largest of a row-by-row balance; otherwise rows are
    balanced one by one.
    """
    lengths = attention_mask.sum(dim=1).tolist()
    b = len(lengths)
    parts = balanced_partition(lengths, dp, equal_size=True)
    units = _whole_groups(groups, dp) if groups is not None else None
    if units is not None:
        unit_parts = balanced_partition([sum(lengths[i] for i in unit) for unit in units], dp, equal_size=True)
        whole = [[i for u in part for i in units[u]] for part in unit_parts]
        if max(_part_sums(whole, lengths)) <= (1 + GROUP_BALANCE_SLACK) * max(_part_sums(parts, lengths)):
            parts = whole
    order = torch.tensor([i for part in parts for i in part], dtype=torch.long)
    shard = b // dp
    before = [sum(lengths[d * shard:(d + 1) * shard]) for d in range(dp)]
    after = _part_sums(parts, lengths)
    return order, seqlen_metrics(before, after)


def _part_sums(parts: list[list[int]], lengths: Sequence[int]) -> list[int]:
    return [sum(lengths[i] for i in part) for part in parts]


def _whole_groups(groups: Sequence[Hashable], dp: int) -> list[list[int]] | None:
    """Rows by group (in order of first appearance) when the groups are equal in size and their
    number is a multiple of `dp`; None otherwise."""
    by_id: dict[Hashable, list[int]] = {}
    for row, group in enumerate(groups):
        by_id.setdefault(group, []).append(row)
    units = list(by_id.values())
    if len(units) % dp or len({len(u) for u in units}) != 1:
        return None
    return units


def balance_applies(rows: int, dp: int) -> bool:
    """Balancing reorders whole shards only: with dp > 1 and rows a multiple of dp."""
    return dp > 1 and rows > 0 and rows % dp == 0
