"""The columns of an RL parquet dataset (verl's layout) and checks that name file, row and column.

One row is one prompt::

    data_source   str                      which scorer judges it, e.g. "openai/gsm8k"
    prompt        list[{role, content}]    chat messages (a plain string is accepted too)
    ability       str                      free-form tag, e.g. "math"
    reward_model  {style, ground_truth}    ground_truth: str, number, list or dict
    extra_info    dict                     anything; passed to the scorer (split, index, ...)

The prompt column's name is configurable (``prompt_key``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.errors import DataError

DATA_SOURCE = "data_source"
ABILITY = "ability"
REWARD_MODEL = "reward_model"
EXTRA_INFO = "extra_info"
GROUND_TRUTH = "ground_truth"


def row_error(file: str, row: int, column: str, problem: str) -> DataError:
    """A DataError worded ``<file>: row <row>, column '<column>': <problem>``."""
    return DataError(f"{file}: row {row}, column '{column}': {problem}")


def read_parquet_schema(path: str | os.PathLike[str]) -> pa.Schema:
    """The schema of a parquet file; DataError naming the file when it is missing or unreadable."""
    if not os.path.exists(path):
        raise DataError(f"{path}: file does not exist")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, expected a parquet file")
    try:
        return pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from exc


def check_columns(path: str, schema: pa.Schema, required: Sequence[str]) -> None:
    """Raise DataError naming the file and the first missing column of ``required``."""
    present = set(schema.names)
    for column in required:
        if column not in present:
            raise DataError(f"{path}: column '{column}' is missing (columns present: {sorted(present)})")


def validate_prompt(value: Any) -> str | list[dict[str, str]]:
    """Return the prompt if it is a non-blank string or a non-empty list of {role, content} string
    messages, not all of them blank.

    Raises ValueError describing what is wrong (the caller adds file, row and column).
    """
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"the prompt is a blank string ({value!r})")
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected a non-empty list of chat messages or a string, got {_describe(value)}")
    for position, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(
                f"message {position} is {_describe(message)}, expected a dict with 'role' and 'content'"
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(
                    f"message {position} has no string '{key}' (got {_describe(message.get(key))})"
                )
    if not any(message["content"].strip() for message in value):
        raise ValueError(f"every message's 'content' is blank ({len(value)} messages)")
    return value


def ground_truth_of(reward_model: Any) -> Any:
    """The ground truth inside a ``reward_model`` cell; ValueError when absent."""
    if not isinstance(reward_model, dict):
        raise ValueError(f"expected a dict with a '{GROUND_TRUTH}' key, got {_describe(reward_model)}")
    if reward_model.get(GROUND_TRUTH) is None:
        raise ValueError(f"has no '{GROUND_TRUTH}' (keys: {sorted(reward_model)})")
    return reward_model[GROUND_TRUTH]


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"
