"""Prompt unpacking and rollout-batch assembly shared by every engine.

Columns of the returned batch (N = B * n rows, P = prompt length, R = ``max_new_tokens``):

- ``prompts`` (N, P) int64: the left-padded prompt ids, each prompt repeated n times in a row.
- ``responses`` (N, R) int64: generated ids, right-padded with the pad id.
- ``response_mask`` (N, R) int64: 1 on generated tokens up to and including the EOS/stop token.
- ``input_ids`` (N, P + R) = cat(prompts, responses).
- ``attention_mask`` (N, P + R) = cat(prompt mask, response_mask).
- ``position_ids`` (N, P + R): prompt positions (cumsum(mask) - 1, clipped at 0, unless the prompt
  batch brings its own), then last prompt position + 1 .. R for the response (as verl).
- ``rollout_log_probs`` (N, R) float32: log-prob of each response token (see
  :mod:`megarl.rollout.base` for the convention), 0 where ``response_mask`` is 0.

Non-tensor columns (``uid``, ``data_source`` ...) and meta travel along, repeated the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megarl.errors import DataError
from megarl.protocol import Batch

PROMPT_TENSOR_COLUMNS = ("input_ids", "attention_mask", "position_ids")


def prompt_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of left-padded prompts: (B, P) int64, cumsum(mask) - 1 clipped at 0."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def check_prompt_tensors(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """Validate a prompt batch: (B, P) int ids, 0/1 mask, left padding, no empty prompt."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise DataError(
            f"prompt batch: input_ids and attention_mask must both be (B, P); got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    if input_ids.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise DataError(f"prompt batch: input_ids must be an integer tensor, got {input_ids.dtype}")
    mask = attention_mask.long()
    if ((mask != 0) & (mask != 1)).any():
        raise DataError("prompt batch: attention_mask must contain only 0 and 1")
    empty = (mask.sum(dim=-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise DataError(f"prompt batch: rows {empty[:8]} have no prompt tokens (attention_mask all 0)")
    # Left padding: once a row has seen a 1, it must stay 1 to the end.
    not_left_padded = (mask[:, 1:] < mask[:, :-1]).any(dim=-1).nonzero().flatten().tolist()
    if not_left_padded:
        raise DataError(
            f"prompt batch: rows {not_left_padded[:8]} are not left-padded (a 0 follows a 1 in "
            "attention_mask); rollout expects prompts padded on the left"
        )


def unpad_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The real prompt tokens of each row, left padding stripped."""
    check_prompt_tensors(input_ids, attention_mask)
    return [row[m.bool()].tolist() for row, m in zip(input_ids.cpu(), attention_mask.cpu())]


def pad_responses(
    token_lists: Sequence[Sequence[int]],
    log_prob_lists: Sequence[Sequence[float]],
    max_new_tokens: int,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad ragged responses to (N, R) ids and (N, R) float32 log-probs; also (N,) lengths."""
    n_rows = len(token_lists)
    tokens = torch.full((n_rows, max_new_tokens), pad_token_id, dtype=torch.long)
    log_probs = torch.zeros((n_rows, max_new_tokens), dtype=torch.float32)
    lengths = torch.zeros(n_rows, dtype=torch.long)
    for i, (ids, lps) in enumerate(zip(token_lists, log_prob_lists)):
        if len(ids) != len(lps):
            raise ValueError(f"row {i}: {len(ids)} tokens but {len(lps)} log-probs")
        k = min(len(ids), max_new_tokens)
        tokens[i, :k] = torch.as_tensor(list(ids[:k]), dtype=torch.long)
        log_probs[i, :k] = torch.as_tensor(list(lps[:k]), dtype=torch.float32)
        lengths[i] = k
    return tokens, log_probs, lengths


def assemble_rollout_batch(
    prompts: Batch,
    responses: torch.Tensor,
    lengths: torch.Tensor,
    log_probs: torch.Tensor,
    n: int,
    pad_token_id: int,
) -> Batch:
    """Build the rollout ``Batch`` (columns in the module doc) from engine outputs.

    Args:
        prompts: the prompt ``Batch`` (B rows) given to ``generate``.
        responses: (B * n, R) generated ids; positions at or after ``lengths`` are overwritten with
            the pad id.
        lengths: (B * n,) kept response tokens per row (including the stop token).
        log_probs: (B * n, R) log-probs of ``responses``; zeroed where masked.
        n: samples per prompt (rows i*n .. i*n+n-1 belong to prompt i).
    """
    input_ids = prompts["input_ids"]
    attention_mask = prompts["attention_mask"].long()
    b, r = input_ids.shape[0], responses.shape[1]
    if responses.shape[0] != b * n or log_probs.shape != responses.shape or lengths.shape != (b * n,):
        raise ValueError(
            f"engine output shapes do not fit {b} prompts x n={n}: responses {tuple(responses.shape)}, "
            f"log_probs {tuple(log_probs.shape)}, lengths {tuple(lengths.shape)}"
        )
    position_ids = prompts["position_ids"] if "position_ids" in prompts else prompt_position_ids(attention_mask)

    response_mask = (torch.arange(r).unsqueeze(0) < lengths.unsqueeze(1)).long()
    responses = torch.where(response_mask.bool(), responses.long(), torch.full_like(responses, pad_token_id))
    log_probs = torch.where(response_mask.bool(), log_probs.float(), torch.zeros_like(log_probs, dtype=torch.float32))

    prompt_ids = input_ids.long().repeat_interleave(n, dim=0)
    prompt_mask = attention_mask.repeat_interleave(n, dim=0)
    prompt_pos = position_ids.long().repeat_interleave(n, dim=0)
    response_pos = prompt_pos[:, -1:] + torch.arange(1, r + 1).unsqueeze(0)

    generated = {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "position_ids": torch.cat([prompt_pos, response_pos], dim=1),
        "rollout_log_probs": log_probs,
    }
    carried_keys = [k for k in prompts.keys() if k not in PROMPT_TENSOR_COLUMNS]
    out = Batch.from_dict(generated, meta=dict(prompts.meta))
    if carried_keys:
        carried = prompts.select(*carried_keys).repeat(n, interleave=True)
        out = out.union(carried)
    return out
