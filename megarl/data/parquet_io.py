"""Writing RL rows to parquet in bounded memory."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from itertools import islice
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.errors import DataError


def write_parquet(
    rows: Iterable[Mapping[str, Any]], path: str | os.PathLike[str], *, chunk_rows: int = 10_000
) -> int:
    """Write ``rows`` (dicts with the same keys and value types) to ``path``; return the row count.

    Rows are converted ``chunk_rows`` at a time, so a generator of millions of rows never sits in
    memory at once. The schema is inferred from the first chunk. The file appears complete or not at
    all (written to a temporary name, then renamed).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    iterator = iter(rows)
    writer: pq.ParquetWriter | None = None
    count = 0
    try:
        while chunk := list(islice(iterator, chunk_rows)):
            table = (
                pa.Table.from_pylist(chunk)
                if writer is None
                else pa.Table.from_pylist(chunk, schema=writer.schema)
            )
            if writer is None:
                writer = pq.ParquetWriter(partial, table.schema)
            writer.write_table(table)
            count += len(chunk)
        if writer is None:
            raise DataError(f"no rows to write to {target}: the source gave none")
        writer.close()
        writer = None
        os.replace(partial, target)
    finally:
        if writer is not None:
            writer.close()
        if partial.exists():
            partial.unlink()
    return count
