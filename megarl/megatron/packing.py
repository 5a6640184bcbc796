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

import torch

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

    longest = int(lengths.max()) if n else 0
    longest_cost = per_rank(1, longest, longest, padded_length(longest, cp))
    if longest_cost > max_tokens:
        share = f", {longest_cost} per rank at context parallel size {cp}" if cp > 1 else ""
        raise ConfigError(
            f"max_token_len_per_micro_batch={max_tokens} is smaller than the longest sequence "
            f"({longest} tokens{share}); raise it to at least {longest_cost}"
        )
    order = torch.sort(lengths, descending=True, stable=True).indices.tolist()
    plans: list[list[int]] = []
    current: list[int] = []
    current_max = current_sum = current_padded = 0
    for idx in order:
        length = int(lengths[idx])
        new_max = max(current_max, length)
        cost = per_rank(len(current) + 1, new_max, current_sum + length, current_padded + padded_length(length, cp))
        if current and cost > max_tokens:
            plans.append(current)
            current, new_max, current_sum, current_padded = [], length, 0, 0
        current.append(idx)
        current_max = new_max
        current_sum += length
        current_padded += padded_length(length, cp)
    if current:
        plans.append(current)
    if packed:
        plans = _balanced_plans(lengths, plans, max_tokens, lambda part: per_rank(
            len(part), max(int(lengths[i]) for i in part), sum(int(lengths[i]) for i in part),
            sum(padded_length(int(lengths[i]), cp) for i in part)))
    return [torch.tensor(sorted(p), dtype=torch.long) for p in plans]


def _balanced_plans(lengths: torch.Tensor, greedy: list[list[int]], max_tokens: int,
                    cost: Callable[[list[int]], int]) -> list[list[int]]:
    """The fewest parts of about equal tokens whose every part costs at most `max_tokens`, from
    ceil(total / budget) parts up to as many as the greedy split has; the greedy split if none fits."""
    values = [int(v) for v in lengths.tolist()]
    fewest = max(1, -(-sum(values) // max_tokens))
    for k in range(min(fewest, len(greedy)), len(greedy) + 1):
        parts = [p for p in balanced_partition(values, k) if p]
        if all(cost(p) <= max_tokens for p in parts):
            return parts
    return greedy


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
