"""Data-parallel dispatch and collection, as pure functions over `RankCoord`s and Batches.

The WorkerGroup uses these to split a Batch across DP ranks and put the results back together;
they hold no Ray state, so they are tested on their own.

    plan = plan_dispatch(infos)                       # which shard each rank gets, who reports back
    shards, pad = split_for_data_parallel(batch, plan.dp_size)
    ... rank r runs on shards[plan.shard_of_rank[r]] ...
    result = merge_data_parallel_results([results[r] for r in plan.collect_ranks], pad)
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


def split_for_data_parallel(batch: Batch, dp_size: int) -> tuple[list[Batch], int]:
    """(dp_size equal shards in row order, number of padding rows added at the end).

    B is padded to a multiple of dp_size by repeating rows from the start (valid data, dropped
    again by `merge_data_parallel_results`), so every rank gets ceil(B / dp_size) rows.
    """
    if len(batch) == 0:
        raise DispatchError("cannot dispatch an empty batch (0 rows) across data-parallel ranks")
    padded, pad = batch.pad_to_multiple(dp_size)
    return padded.chunk(dp_size), pad


def merge_data_parallel_results(results: Sequence[Any], pad: int) -> Any:
    """Put per-shard results (in DP order) back into one result for the original B rows.

    Batches are concatenated and tensors are concatenated on dim 0, then the last `pad` rows are
    dropped. If every result is None the answer is None. Anything else (metrics dicts, lists) is
    returned as the list of per-shard results, unchanged.
    """
    if all(result is None for result in results):
        return None
    if all(isinstance(result, Batch) for result in results):
        return Batch.concat(results).unpad(pad)
    if all(isinstance(result, torch.Tensor) for result in results):
        merged = torch.cat(list(results), dim=0)
        return merged[: merged.shape[0] - pad]
    return list(results)
