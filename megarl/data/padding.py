"""Prompt truncation and left padding (pure functions on token id lists)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Truncation = Literal["error", "left", "right", "middle"]
TRUNCATION_MODES: tuple[str, ...] = ("error", "left", "right", "middle")


class PromptTooLongError(ValueError):
    """Raised by :func:`truncate_ids` in ``error`` mode; the caller adds file and row."""


def truncate_ids(ids: Sequence[int], max_length: int, mode: str) -> list[int]:
    """Cut ``ids`` to at most ``max_length`` tokens.

    ``left`` drops the beginning (keeps the last ``max_length`` tokens), ``right`` drops the end,
    ``middle`` keeps the first ``max_length // 2`` and the last ``max_length - max_length // 2``,
    ``error`` raises :class:`PromptTooLongError` when the prompt is too long.
    """
    if mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation mode {mode!r} is not one of {list(TRUNCATION_MODES)}")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    ids = list(ids)
    if len(ids) <= max_length:
        return ids
    if mode == "error":
        raise PromptTooLongError(f"prompt has {len(ids)} tokens, more than max_prompt_length={max_length}")
    if mode == "left":
        return ids[-max_length:]
    if mode == "right":
        return ids[:max_length]
    head = max_length // 2
    tail = max_length - head
    return ids[:head] + ids[-tail:]


def left_pad(
    sequences: Sequence[Sequence[int]], pad_token_id: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad token id lists into a batch.

    Returns ``(input_ids, attention_mask, position_ids)``, each int64 of shape (B, L) where ``L`` is
    ``length`` or, when None, the longest sequence. ``attention_mask`` is 1 on real tokens;
    ``position_ids`` is ``cumsum(mask) - 1`` clipped at 0 (so 0 on padding and on the first token).
    """
    longest = max((len(s) for s in sequences), default=0)
    width = longest if length is None else length
    if longest > width:
        raise ValueError(f"a sequence of {longest} tokens does not fit into length {width}")
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq):
            input_ids[row, width - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
            attention_mask[row, width - len(seq) :] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids
