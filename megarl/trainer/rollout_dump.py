"""Generations as JSONL, one file per step: verl's ``trainer.rollout_data_dir`` / ``validation_data_dir``.

``<out_dir>/<step>.jsonl`` holds one JSON object per response, in batch row order:

- ``step`` (int); ``uid``, ``data_source``, ``ground_truth`` when the batch has those columns;
- ``input``: the prompt ids where ``attention_mask[:, :P]`` is 1 (left padding dropped), decoded;
- ``output``: the response ids where ``response_mask`` is 1 (right padding dropped), decoded. Special
  tokens are kept (chat markers, the EOS that ended the response): the masks, not the tokenizer,
  remove padding, so a response cut at the length limit is visible as one without EOS;
- ``score``: sum over tokens of ``token_level_scores``; ``reward``: sum of ``token_level_rewards``
  (the score minus the KL penalty when KL is in the reward); each only when the column exists;
- ``advantage``: ``advantages`` at the first response token. Outcome estimators (GRPO, RLOO,
  REINFORCE++ ...) give every token of a response the same value, so this is the per-sequence
  advantage; for GAE it is the first token's. ``null`` for an empty response;
- ``response_length``: response tokens (int);
- ``rollout_weights_version``: how many actor updates the weights that generated the row had had
  (training at step ``s`` uses version ``s - 1``, or fewer after a critic warm-up, whose steps do not
  update the actor: a row of the version the step trains is on-policy); with
  partial rollout the oldest of its tokens' versions, and ``token_versions``: each response token's;
- ``<key>`` for each ``reward_info/<key>`` column (``reward_info/<key>`` when ``<key>`` is already a
  field above, e.g. the scorer's own ``score`` before overlong shaping).

Values are strict JSON: numpy and torch scalars become Python numbers, arrays lists, NaN/inf null.
The file is written to a temporary name and renamed, so a reader or a crash never sees half a file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from megarl.protocol import Batch
from megarl.rollout.partial import TOKEN_VERSIONS  # partial rollout: each response token's version

_OPTIONAL_OBJECT_COLUMNS = ("uid", "data_source", "ground_truth")
_SUMMED_COLUMNS = {"score": "token_level_scores", "reward": "token_level_rewards"}
# The weight version (actor updates before it) each row was generated under.
_VERSION_COLUMN = "rollout_weights_version"
_FIELDS = {"step", "input", "output", "advantage", "response_length", _VERSION_COLUMN, "token_versions",
           *_OPTIONAL_OBJECT_COLUMNS, *_SUMMED_COLUMNS}


def json_safe(value: Any) -> Any:
    """`value` with numpy/torch scalars and arrays as Python values, NaN/inf as None (for strict JSON)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return json_safe(value.tolist())
    if isinstance(value, np.generic):
        return json_safe(value.item())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)


def generation_records(batch: Batch, tokenizer: PreTrainedTokenizerBase, step: int) -> list[dict[str, Any]]:
    """One JSON-safe dict per row of a rollout batch (fields in the module docstring).

    Needs ``prompts`` (N, P), ``responses`` (N, R), ``attention_mask`` (N, P + R); uses
    ``response_mask`` (N, R) when present, else ``attention_mask[:, P:]``.
    """
    prompts, responses = batch["prompts"].cpu(), batch["responses"].cpu()
    p = prompts.shape[1]
    prompt_mask = batch["attention_mask"][:, :p].cpu().bool()
    mask_source = batch["response_mask"] if "response_mask" in batch else batch["attention_mask"][:, p:]
    response_mask = mask_source.cpu().bool()
    inputs = tokenizer.batch_decode([row[m].tolist() for row, m in zip(prompts, prompt_mask)])
    outputs = tokenizer.batch_decode([row[m].tolist() for row, m in zip(responses, response_mask)])
    lengths = response_mask.sum(dim=-1).tolist()

    columns: dict[str, list[Any]] = {}
    for key in _OPTIONAL_OBJECT_COLUMNS:
        if key in batch:
            columns[key] = list(batch[key])
    for field, key in _SUMMED_COLUMNS.items():
        if key in batch:
            columns[field] = batch[key].detach().float().cpu().sum(dim=-1).tolist()
    if _VERSION_COLUMN in batch:
        columns[_VERSION_COLUMN] = batch[_VERSION_COLUMN].tolist()
    if TOKEN_VERSIONS in batch:
        columns["token_versions"] = [row[m].tolist() for row, m in zip(batch[TOKEN_VERSIONS].cpu(), response_mask)]
    if "advantages" in batch:
        # Right-padded responses start at column 0: that is the first response token.
        first = batch["advantages"].detach().float().cpu()[:, 0].tolist()
        columns["advantage"] = [value if n > 0 else None for value, n in zip(first, lengths)]
    for key in batch.non_tensor_keys:
        if key.startswith("reward_info/"):
            name = key.split("/", 1)[1]
            columns[key if name in _FIELDS else name] = list(batch[key])

    records = []
    for i in range(len(batch)):
        record: dict[str, Any] = {"step": int(step)}
        if "uid" in columns:
            record["uid"] = columns["uid"][i]
        record.update(input=inputs[i], output=outputs[i])
        record.update({name: values[i] for name, values in columns.items() if name != "uid"})
        record["response_length"] = int(lengths[i])
        records.append(json_safe(record))
    return records


def write_jsonl_atomic(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write `records` one per line to `path` through a temporary file and a rename; returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def dump_rollouts(batch: Batch, tokenizer: PreTrainedTokenizerBase, step: int, out_dir: str | Path) -> Path:
    """Write the training step's generations to ``<out_dir>/<step>.jsonl``; returns that path."""
    return write_jsonl_atomic(generation_records(batch, tokenizer, step), Path(out_dir) / f"{int(step)}.jsonl")


def dump_validation(
    batches: Sequence[Batch], tokenizer: PreTrainedTokenizerBase, step: int, out_dir: str | Path
) -> Path:
    """Write the validation generations of all `batches` (in order) to ``<out_dir>/<step>.jsonl``.

    Each batch is a scored rollout batch (``token_level_scores`` and ``reward_info/<key>`` set as in
    training); validation runs in several batches, so they go to one file together.
    """
    records = [record for batch in batches for record in generation_records(batch, tokenizer, step)]
    return write_jsonl_atomic(records, Path(out_dir) / f"{int(step)}.jsonl")
