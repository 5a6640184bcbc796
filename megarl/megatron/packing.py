"""Remove padding and plan micro-batches (fixed size or by a token budget).

Rows arrive as [left-padded prompt | right-padded response]. Each row is compacted so that its
valid tokens (attention_mask == 1) start at position 0; a micro-batch is then trimmed to its longest
row. Trailing padding cannot influence earlier tokens under a causal mask, so no attention mask is
needed, and positions equal HF's `cumsum(mask) - 1`. The log-prob of response token t of row i
comes from compact position L_i + t - 1 (L_i = valid prompt tokens of row i).

Under context parallelism (`megarl.megatron.context_parallel`) the token budget of dynamic
micro-batching counts the positions one CP rank computes, after padding to a multiple of 2*cp.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.errors import ConfigError, DataError
from megarl.megatron.context_parallel import padded_length
from megarl.protocol.balance import balanced_partition


@dataclass
class CompactRows:
    """Rows with their valid tokens moved to the front.

    tokens: (B, T) int64, T = longest valid length; positions past a row's length hold 0.
    prompt_lens: (B,) valid prompt tokens L_i. total_lens: (B,) valid tokens T_i.
    response_len: R, the width of the response columns of the batch.
    """

    tokens: torch.Tensor
    prompt_lens: torch.Tensor
    total_lens: torch.Tensor
    response_len: int

    def to(self, device: torch.device) -> "CompactRows":
        return CompactRows(self.tokens.to(device), self.prompt_lens.to(device), self.total_lens.to(device),
                           self.response_len)


def compact_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int) -> CompactRows:
    """Move each row's valid tokens to the front (stable order). input_ids/attention_mask: (B, P+R)."""
    if input_ids.shape != attention_mask.shape:
        raise DataError(f"input_ids {tuple(input_ids.shape)} vs attention_mask {tuple(attention_mask.shape)}")
    mask = attention_mask.bool()
    prompt_width = input_ids.shape[1] - response_len
    prompt_lens = mask[:, :prompt_width].sum(1)
    if response_len > 0 and bool((prompt_lens == 0).any()):
        row = int((prompt_lens == 0).nonzero()[0])
        raise DataError(f"row {row} has no valid prompt token: its first response token has no context")
    total = mask.sum(1)
    width = max(int(total.max()), 1)
    # Stable sort puts valid positions first, in their original order.
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :width]
    tokens = input_ids.gather(1, order)
    keep = torch.arange(width, device=total.device).unsqueeze(0) < total.unsqueeze(1)
    tokens = torch.where(keep, tokens, torch.zeros_like(tokens))
    return CompactRows(tokens, prompt_lens, total, response_len)


def response_index(rows: CompactRows) -> tuple[torch.Tensor, torch.Tensor]:
    """(index (B, R), valid (B, R)): compact position whose output predicts response token t."""
    t = torch.arange(rows.response_len, device=rows.prompt_lens.device).unsqueeze(0)
    index = rows.prompt_lens.unsqueeze(1) + t - 1
    valid = index < (rows.total_lens - 1).unsqueeze(1)
    return index.clamp(max=max(rows.tokens.shape[1] - 1, 0)), valid


def gather_response(per_position: torch.Tensor, rows: CompactRows) -> torch.Tensor:
    """Per-position values (B, T) -> response-aligned (B, R); 0 where the response is padding."""
    index, valid = response_index(rows)
    width = per_position.shape[1]
    out = per_position.gather(1, index.clamp(max=width - 1))
    return torch.where(valid, out, torch.zeros_like(out))


def plan_micro_batches(
    lengths: torch.Tensor,
    micro_batch_size: int | None = None,
    max_tokens: int | None = None,
    packed: bool = False,
    cp: int = 1,
    pad_each: bool = False,
    min_micro_batches: int = 1,
) -> list[torch.Tensor]:
    """Row indices of each micro-batch.

    Fixed: consecutive chunks of `micro_batch_size`. Dynamic (`max_tokens` set): rows sorted by
    length, a micro-batch closes when the tokens one rank computes would exceed `max_tokens`: rows x
    longest row when padded, the sum of the lengths when `packed`. When `packed`, the rows are then
    re-split into the fewest micro-batches of about equal tokens that still fit the budget
    (`megarl.protocol.balance.balanced_partition`): never more micro-batches than the greedy split,
    often one fewer. Padded micro-batches keep the sorted split, which groups rows of similar length
    (a balanced split would mix lengths and pay for the padding).

    Context parallelism (`cp` > 1): the budget is per rank, like verl's `*_max_token_len_per_gpu`.
    A micro-batch's sequence axis is padded to a multiple of 2*cp (each sequence on its own when
    `pad_each`, TransformerEngine's THD packing) and split `cp` ways, so a micro-batch holds up to
    about `cp` times the budget in total and each rank computes at most `max_tokens` positions.

    `min_micro_batches` (dynamic only; at most the number of rows): the count that another rank
    needs (`plan_micro_batches_across`). Where the budget needs fewer, the sorted split is made at
    the smallest budget that still gives no more than that many, and the costliest micro-batch is
    split in two until there are as many; packed rows first try a balanced split into that many.
    Every micro-batch stays within `max_tokens`.
    """
    n = int(lengths.numel())
    if max_tokens is None:
        if not micro_batch_size or micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        return [torch.arange(i, min(i + micro_batch_size, n)) for i in range(0, n, micro_batch_size)]

    def per_rank(count: int, longest: int, total: int, padded_sum: int) -> int:
        if packed:
            tokens = padded_sum if pad_each else padded_length(total, cp)
        else:
            tokens = count * padded_length(longest, cp)
        return tokens // cp  # exact: padded to a multiple of 2*cp when cp > 1

    if n == 0:
        return []
    if min_micro_batches > n:
        raise DataError(f"cannot split {n} rows into {min_micro_batches} non-empty micro-batches")
    longest = int(lengths.max())
    longest_cost = per_rank(1, longest, longest, padded_length(longest, cp))
    if longest_cost > max_tokens:
        share = f", {longest_cost} per rank at context parallel size {cp}" if cp > 1 else ""
        raise ConfigError(
            f"max_token_len_per_micro_batch={max_tokens} (a run's `<role>.ppo_max_token_len_per_gpu`) is smaller "
            f"than the longest sequence ({longest} tokens{share}); raise it to at least {longest_cost}"
        )
    order = torch.sort(lengths, descending=True, stable=True).indices.tolist()

    def greedy(budget: int) -> list[list[int]]:
        """Rows by length, longest first, a micro-batch closed when the next row would exceed
        `budget`: the fewest micro-batches of consecutive rows in that order."""
        plans: list[list[int]] = []
        current: list[int] = []
        current_max = current_sum = current_padded = 0
        for idx in order:
            length = int(lengths[idx])
            new_max = max(current_max, length)
            cost = per_rank(len(current) + 1, new_max, current_sum + length,
                            current_padded + padded_length(length, cp))
            if current and cost > budget:
                plans.append(current)
                current, new_max, current_sum, current_padded = [], length, 0, 0
            current.append(idx)
            current_max = new_max
            current_sum += length
            current_padded += padded_length(length, cp)
        if current:
            plans.append(current)
        return plans

    plans = greedy(max_tokens)
    if len(plans) < min_micro_batches:
        # More micro-batches than the budget needs: the smallest budget at which the greedy split
        # still needs no more than asked (bisected; fewer micro-batches at a larger budget) gives
        # the most even split of the sorted rows; the costliest parts are then split up to the count.
        low, high = longest_cost, max_tokens
        while low < high:
            mid = (low + high) // 2
            if len(greedy(mid)) <= min_micro_batches:
                high = mid
            else:
                low = mid + 1
        plans = greedy(low)

    def cost(part: list[int]) -> int:
        return per_rank(len(part), max(int(lengths[i]) for i in part), sum(int(lengths[i]) for i in part),
                        sum(padded_length(int(lengths[i]), cp) for i in part))

    if packed:
        plans = _balanced_plans(lengths, plans, max_tokens, cost, min_micro_batches)
    if len(plans) < min_micro_batches:
        plans = _split_costliest(lengths, plans, min_micro_batches, cost)
    return [torch.tensor(sorted(p), dtype=torch.long) for p in plans]


def _balanced_plans(lengths: torch.Tensor, greedy: list[list[int]], max_tokens: int,
                    cost: Callable[[list[int]], int], at_least: int = 1) -> list[list[int]]:
    """The fewest (and at least `at_least`) parts of about equal tokens whose every part costs at
    most `max_tokens`, from the fewest the budget allows up to as many as the greedy split has; the
    greedy split if none fits. The fewest: all rows cost no more as one part than split (padding is
    rounded up per part), so k parts need k * max_tokens >= cost(all rows); at cp > 1 that counts
    the positions of one CP rank, as the budget does."""
    values = [int(v) for v in lengths.tolist()]
    fewest = max(1, -(-cost(list(range(len(values)))) // max_tokens))
    for k in range(max(min(fewest, len(greedy)), at_least), max(len(greedy), at_least) + 1):
        parts = [p for p in balanced_partition(values, k) if p]
        if len(parts) >= at_least and all(cost(p) <= max_tokens for p in parts):
            return parts
    return greedy


def _split_costliest(lengths: torch.Tensor, plans: list[list[int]], count: int,
                     cost: Callable[[list[int]], int]) -> list[list[int]]:
    """`plans` split until there are `count` parts (count <= rows): each time the costliest part of
    two or more rows, sorted by length (longest first, so the padded halves stay of similar
    length), is cut where its larger half costs least."""
    plans = [list(p) for p in plans]
    while len(plans) < count:
        splittable = [i for i, p in enumerate(plans) if len(p) > 1]
        if not splittable:
            raise DataError(f"cannot split {sum(map(len, plans))} rows into {count} non-empty micro-batches")
        rows = sorted(plans.pop(max(splittable, key=lambda i: cost(plans[i]))),
                      key=lambda i: (-int(lengths[i]), i))
        # cost(rows[:j]) grows with j and cost(rows[j:]) shrinks: bisect for where they cross.
        lo, hi = 1, len(rows) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if cost(rows[:mid]) >= cost(rows[mid:]):
                hi = mid
            else:
                lo = mid + 1
        cut = min((j for j in (lo - 1, lo) if j >= 1), key=lambda j: max(cost(rows[:j]), cost(rows[j:])))
        plans += [rows[:cut], rows[cut:]]
    return plans


def plan_micro_batches_across(lengths: torch.Tensor, group: Any, device: torch.device, who: str,
                              **plan: Any) -> list[torch.Tensor]:
    """`plan_micro_batches` with a token budget (`plan`: its keyword arguments), giving every rank
    of `group` the same number of micro-batches: the most any of them needs under the budget.

    Each rank plans from its own rows, so the counts can differ; a collective that runs once per
    micro-batch among ranks of the group (the token dispatch of expert parallelism, whose groups
    span data-parallel ranks) would then wait for a micro-batch that never comes. verl forces the
    same count the same way. A rank that needs fewer splits its micro-batches further
    (`min_micro_batches`), which keeps them within the budget but needs as many rows as the count:
    if a rank has fewer, every rank raises the same error (no rank is left waiting). `who` names
    the caller (role and rank) in that error."""
    plans = plan_micro_batches(lengths, **plan)
    # One all-reduce for both: the most micro-batches any rank needs, the fewest rows any rank has.
    counts = torch.tensor([len(plans), -int(lengths.numel())], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    most, fewest_rows = int(counts[0]), -int(counts[1])
    if most > fewest_rows:
        raise DataError(
            f"{who}: with use_dynamic_bsz every data-parallel rank runs the same number of micro-batches, "
            f"and one rank needs {most} under max_token_len_per_micro_batch={plan.get('max_tokens')}, but "
            f"another has only {fewest_rows} rows (this rank has {int(lengths.numel())}); give every "
            f"data-parallel rank the same number of rows (the trainer's dispatcher does) or raise "
            f"max_token_len_per_micro_batch (a run's `<role>.ppo_max_token_len_per_gpu`)")
    if most > len(plans):
        plans = plan_micro_batches(lengths, **plan, min_micro_batches=most)
    return plans


@dataclass
class PackedRows:
    """The rows of one micro-batch concatenated into a single row of S tokens.

    tokens: (1, S). offsets: (b,) start of each row. lengths: (b,) valid tokens of each row.
    padded_lengths: (b,) room each row takes (its length rounded up to `align`; zeros fill the rest).
    attention_mask: (1, 1, S, S) bool, True = masked (causal within each row, nothing across rows);
    None on the TransformerEngine path, which takes `cu_seqlens` (THD format) instead.
    cu_seqlens: (b+1,) int32 boundaries of the padded rows. seq_ids: (S,) which row each position
    belongs to (its padding included).
    """

    tokens: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    attention_mask: torch.Tensor | None
    cu_seqlens: torch.Tensor
    padded_lengths: torch.Tensor
    seq_ids: torch.Tensor


def pack_rows(rows: CompactRows, with_mask: bool = True, align: int = 1) -> PackedRows:
    """Concatenate each row's valid tokens. With `align` > 1 each row is followed by zeros up to a
    multiple of `align` (TransformerEngine's THD context parallelism splits every sequence into
    2*cp chunks); with 1 there is no padding at all."""
    lengths = rows.total_lens
    device = lengths.device
    padded = ((lengths + align - 1) // align) * align
    offsets = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths), device=device), padded)
    within = torch.arange(total, device=device) - offsets[seq_ids]
    valid = within < lengths[seq_ids]
    source = rows.tokens[seq_ids, within.clamp(max=rows.tokens.shape[1] - 1)]
    tokens = torch.where(valid, source, torch.zeros_like(source)).unsqueeze(0)
    mask = None
    if with_mask:
        pos = torch.arange(total, device=device)
        visible = (seq_ids.unsqueeze(1) == seq_ids.unsqueeze(0)) & (pos.unsqueeze(1) >= pos.unsqueeze(0))
        mask = (~visible).unsqueeze(0).unsqueeze(0)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32, device=device), torch.cumsum(padded, 0).int()])
    return PackedRows(tokens, offsets, lengths, mask, cu, padded, seq_ids)


def packed_seq_ids(packed: PackedRows, width: int) -> torch.Tensor:
    """(width,) which row each position of the packed row (padded to `width`) belongs to; -1 for
    positions past the last row."""
    ids = packed.seq_ids
    tail = torch.full((width - ids.numel(),), -1, dtype=ids.dtype, device=ids.device)
    return torch.cat([ids, tail])


def unpack(per_position: torch.Tensor, packed: PackedRows, width: int) -> torch.Tensor:
    """Packed per-position values (1, S) -> (b, width), row-aligned like CompactRows; 0 past a row's end."""
    pos = torch.arange(width, device=per_position.device).unsqueeze(0)
    index = (packed.offsets.unsqueeze(1) + pos).clamp(max=per_position.shape[1] - 1)
    out = per_position[0][index]
    return torch.where(pos < packed.lengths.unsqueeze(1), out, torch.zeros_like(out))
