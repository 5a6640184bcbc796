"""Finding the rows of a parquet file whose text is not valid UTF-8.

Arrow stores a parquet string column without checking its bytes; the error comes later, when a
value becomes a Python ``str`` (a bare UnicodeDecodeError with no file, row or column). These
helpers read the columns again with every string type replaced by its binary twin, so each value
arrives as ``bytes``, and decode them one by one to name the row. They run only once a decode has
failed (or when bad rows are to be skipped), so the clean path pays nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

_BATCH_ROWS = 65536


def as_binary_type(data_type: pa.DataType) -> pa.DataType:
    """``data_type`` with every (large) string inside it, at any depth, replaced by (large) binary."""
    if pa.types.is_string(data_type):
        return pa.binary()
    if pa.types.is_large_string(data_type):
        return pa.large_binary()
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        item = data_type.value_field
        make = pa.list_ if pa.types.is_list(data_type) else pa.large_list
        return make(pa.field(item.name, as_binary_type(item.type), item.nullable))
    if pa.types.is_struct(data_type):
        return pa.struct([pa.field(f.name, as_binary_type(f.type), f.nullable) for f in data_type])
    if pa.types.is_map(data_type):
        return pa.map_(as_binary_type(data_type.key_type), as_binary_type(data_type.item_type))
    return data_type


def _first_undecodable(value: Any) -> UnicodeDecodeError | None:
    """The first decode error among the bytes inside ``value`` (nested lists, dicts, tuples)."""
    if isinstance(value, bytes):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError as exc:
            return exc
        return None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            if (error := _first_undecodable(item)) is not None:
                return error
    return None


def non_utf8_rows(path: str, columns: Sequence[str] | None = None) -> Iterator[tuple[int, str, str]]:
    """``(row, column, problem)`` for each cell of ``path`` (only ``columns``, default all) holding
    text that is not valid UTF-8, in row order; ``problem`` names the byte and shows the value."""
    parquet = pq.ParquetFile(path)
    names = [n for n in (columns if columns is not None else parquet.schema_arrow.names)
             if n in parquet.schema_arrow.names]
    text_columns = [n for n in names if as_binary_type(parquet.schema_arrow.field(n).type)
                    != parquet.schema_arrow.field(n).type]
    if not text_columns:
        return
    offset = 0
    for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, columns=text_columns):
        bad: list[tuple[int, str, str]] = []
        for name in text_columns:
            column = batch.column(name)
            try:
                column.validate(full=True)  # fast: the whole chunk at once, in C++
                continue
            except pa.ArrowInvalid:
                pass
            for row, value in enumerate(column.cast(as_binary_type(column.type)).to_pylist()):
                if (error := _first_undecodable(value)) is not None:
                    shown = error.object[max(0, error.start - 20): error.end + 20]
                    bad.append((offset + row, name, f"text is not valid UTF-8 (byte 0x{error.object[error.start]:02x} "
                                                    f"at position {error.start} of {shown!r})"))
        yield from sorted(bad)
        offset += batch.num_rows
