"""Data-parallel dispatch and collection, as pure functions over `RankCoord`s and Batches.

The WorkerGroup uses these to split a Batch across DP ranks and put the results back together;
they hold no Ray state, so they are tested on their own.

    plan = plan_dispatch(infos)                       # which shard each rank gets, who reports back
    shards, padding = split_for_data_parallel(batch, plan.dp_size)
    ... rank r runs on shards[plan.shard_of_rank[r]] ...
    result = merge_data_parallel_results([results[r] for r in plan.collect_ranks], padding)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarl.errors import MegarlError
from megarl.layout import RankCoord
from megarl.protocol import Batch


class DispatchError(MegarlError, ValueError):
    """The ranks' parallel coordinates do not describe a valid data-parallel layout."""


@dataclass(frozen=True)
class DispatchPlan:
    """How one data-parallel call maps onto the ranks of a group.

    shard_of_rank[r]: index of the data shard global rank r receives (its dp_rank).
    collect_ranks[d]: the global rank whose result stands for data shard d.
    """

    dp_size: int
    shard_of_rank: tuple[int, ...]
    collect_ranks: tuple[int, ...]


def plan_dispatch(infos: Sequence[RankCoord]) -> DispatchPlan:
    """Check the ranks' coordinates and derive the plan. `infos[r]` must be rank r's."""
    if not infos:
        raise DispatchError("cannot dispatch to an empty worker group")
    for position, info in enumerate(infos):
        if info.rank != position:
            raise DispatchError(f"rank coordinates at position {position} belongs to rank {info.rank}")
    dp_sizes = sorted({info.dp_size for info in infos})
    if len(dp_sizes) != 1:
        raise DispatchError(f"ranks disagree on the data-parallel size: {dp_sizes}")
    dp_size = dp_sizes[0]
    collectors: dict[int, list[int]] = {d: [] for d in range(dp_size)}
    for info in infos:
        if not 0 <= info.dp_rank < dp_size:
            raise DispatchError(f"rank {info.rank} has dp_rank {info.dp_rank} outside [0, {dp_size})")
        if info.is_collect_rank:
            collectors[info.dp_rank].append(info.rank)
    for dp_rank, ranks in collectors.items():
        if len(ranks) != 1:
            raise DispatchError(
                f"data-parallel rank {dp_rank} needs exactly one rank that is the last pipeline stage "
                f"and tensor/context-parallel rank 0 to collect from; found ranks {ranks}"
            )
    return DispatchPlan(
        dp_size=dp_size,
        shard_of_rank=tuple(info.dp_rank for info in infos),
        collect_ranks=tuple(collectors[d][0] for d in range(dp_size)),
    )


@dataclass(frozen=True)
class ShardPadding:
    """How `split_for_data_parallel` padded a batch, which `merge_data_parallel_results` undoes.

    rows: padding rows added at the end (repeats of the first rows); shard_rows: rows in every
    shard; shards: the number of shards. The merge needs the shard size and not only `rows`: a
    method may return several rows per input row (rollout's n samples), and then a padding row
    stands for that many output rows, at the end of the shard it landed in.
    """

    rows: int
    shard_rows: int
    shards: int

    def real_rows(self, shard: int) -> int:
        """Rows of the original batch in shard `shard` (the padding rows are its last ones)."""
        original = self.shards * self.shard_rows - self.rows
        return max(0, min(self.shard_rows, original - shard * self.shard_rows))


def split_for_data_parallel(batch: Batch, dp_size: int) -> tuple[list[Batch], ShardPadding]:
    """(dp_size equal shards in row order, how they were padded).

    B is padded to a multiple of dp_size by repeating rows from the start (valid data, dropped
    again by `merge_data_parallel_results`), so every rank gets ceil(B / dp_size) rows. The padding
    rows are the last ones of the padded batch: the end of the last shard, or (B < dp_size) whole
    shards at the end.
    """
    if len(batch) == 0:
        raise DispatchError("cannot dispatch an empty batch (0 rows) across data-parallel ranks")
    padded, pad = batch.pad_to_multiple(dp_size)
    return padded.chunk(dp_size), ShardPadding(rows=pad, shard_rows=len(padded) // dp_size, shards=dp_size)


def merge_data_parallel_results(results: Sequence[Any], padding: ShardPadding, method: str | None = None) -> Any:
    """Put per-shard results (in DP order) back into one result for the original B rows.

    Batches and tensors (on dim 0) keep, from each shard's result, the rows that come from the
    shard's real rows, and are concatenated. A result may hold several rows per input row (rollout's
    n samples, each input row's outputs together and in input order): len(result) / shard rows,
    per shard, which must be whole where there is padding to drop. If every result is None the
    answer is None. Anything else (metrics dicts, lists) is returned as the list of per-shard
    results, unchanged. `method`: the called method's name, for the error messages.
    """
    if all(result is None for result in results):
        return None
    if len(results) != padding.shards:
        raise DispatchError(f"{method or 'a data-parallel call'}: got {len(results)} shard results "
                            f"for {padding.shards} data shards")
    if all(isinstance(result, Batch) for result in results):
        return Batch.concat([result[:_kept_rows(result, d, padding, method)] for d, result in enumerate(results)])
    if all(isinstance(result, torch.Tensor) for result in results):
        return torch.cat([result[:_kept_rows(result, d, padding, method)] for d, result in enumerate(results)], dim=0)
    return list(results)


def _kept_rows(result: Batch | torch.Tensor, shard: int, padding: ShardPadding, method: str | None) -> int:
    """How many leading rows of shard `shard`'s result come from real (not padding) input rows."""
    rows = len(result)
    if padding.rows == 0:  # nothing to drop: every row is kept, whatever the method returns per row
        return rows
    per_row, rest = divmod(rows, padding.shard_rows)
    if rest:
        # Which output belongs to which input row is unknown, so the padding rows' outputs cannot
        # be told apart from the real ones: refuse rather than keep or drop the wrong rows.
        raise DispatchError(
            f"{method or 'a data-parallel call'} returned {rows} rows for data shard {shard} of "
            f"{padding.shard_rows} rows; a Batch or tensor result must hold the same whole number of "
            "rows for every input row"
        )
    return per_row * padding.real_rows(shard)
