"""Helpers for the data tests: rows in verl's layout, parquet writing, a character tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

DIGITS_AND_OPS = "0123456789+-*= "


def row(content: str, answer: str = "0", data_source: str = "arithmetic", index: int = 0) -> dict[str, Any]:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": index},
    }


def write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)
