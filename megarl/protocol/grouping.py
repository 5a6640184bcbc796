"""Row grouping for batches: piece sizes, group ids by a key column, length-balanced partitions."""

from __future__ import annotations

import heapq

import numpy as np
import torch


def group_ids(values: np.ndarray | torch.Tensor, key: str = "column") -> torch.Tensor:
    """Group id per row, numbered 0, 1, ... in order of first appearance.

    values: (B,) object array of hashable values, or a (B,) tensor. Returns an int64 tensor (B,);
    rows with equal values share an id, e.g. ["b", "a", "b"] -> [0, 1, 0].
    `key` names the column in error messages.
    """
    if isinstance(values, torch.Tensor):
        if values.ndim != 1:
            raise ValueError(f"cannot group by {key!r}: it has shape {tuple(values.shape)}, need (B,)")
        if len(values) == 0:
            return torch.zeros(0, dtype=torch.int64)
        _, sorted_ids = torch.unique(values.cpu(), return_inverse=True)
        positions = torch.arange(len(values))
        # First row of each sorted id, then rank ids by it to number them by first appearance.
        first_row = torch.full((int(sorted_ids.max()) + 1,), len(values), dtype=torch.int64)
        first_row.scatter_reduce_(0, sorted_ids, positions, reduce="amin")
        rank = torch.empty_like(first_row)
        rank[first_row.argsort()] = torch.arange(len(first_row))
        return rank[sorted_ids]
    ids: dict[object, int] = {}
    try:
        out = [ids.setdefault(value, len(ids)) for value in values]
    except TypeError as error:
        raise TypeError(f"cannot group by {key!r}: its values must be hashable ({error})") from None
    return torch.tensor(out, dtype=torch.int64)


def balanced_partition(lengths: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Split rows into parts of the given sizes, keeping the sums of `lengths` per part close.

    lengths: (B,) non-negative workload per row (e.g. tokens); sizes: rows per part, summing to B.
    Returns one int64 tensor of row numbers per part, ascending. Greedy: rows from longest to
    shortest, each to the part with the smallest load that still has room (ties: lower part).
    """
    if sum(sizes) != len(lengths):
        raise ValueError(f"part sizes {sizes} sum to {sum(sizes)}, but there are {len(lengths)} rows")
    order = torch.sort(lengths.cpu(), descending=True, stable=True).indices.tolist()
    loads = lengths.cpu().tolist()
    heap = [(0, part) for part, size in enumerate(sizes) if size > 0]
    heapq.heapify(heap)
    members: list[list[int]] = [[] for _ in sizes]
    for row in order:
        load, part = heapq.heappop(heap)
        members[part].append(row)
        if len(members[part]) < sizes[part]:
            heapq.heappush(heap, (load + loads[row], part))
    return [torch.tensor(sorted(rows), dtype=torch.int64) for rows in members]


def check_positive(what: str, value: int) -> None:
    """Raise ValueError naming `what` unless value is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")


def chunk_sizes(total: int, k: int, allow_empty: bool) -> list[int]:
    """k sizes summing to total, differing by at most one, larger first."""
    check_positive("number of chunks", k)
    if k > total and not allow_empty:
        raise ValueError(f"cannot chunk {total} rows into {k} non-empty pieces; "
                         f"pass allow_empty=True to accept {k - total} empty pieces")
    base, extra = divmod(total, k)
    return [base + 1 if piece < extra else base for piece in range(k)]
