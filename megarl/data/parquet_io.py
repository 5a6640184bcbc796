"""Writing RL rows to parquet in bounded memory.

The rows are converted a chunk at a time and the schema is the first chunk's, so a later row that
does not fit it (a key the first chunk did not have, a value of another type) would be dropped or
converted by pyarrow without a word, or fail with an error that names no row. Each chunk's inferred
types are therefore compared with the schema first; a row that does not fit is a DataError naming
the file, the row, the key path (``extra_info.tags[]``: the items of a list) and the type expected.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from itertools import islice
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.errors import DataError

# What pyarrow raises for a value it cannot convert (a too large int is an OverflowError).
_CONVERSION_ERRORS = (pa.ArrowException, TypeError, ValueError, OverflowError)


def write_parquet(
    rows: Iterable[Mapping[str, Any]], path: str | os.PathLike[str], *, chunk_rows: int = 10_000
) -> int:
    """Write ``rows`` (dicts with the same keys and value types) to ``path``; return the row count.

    Rows are converted ``chunk_rows`` at a time, so a generator of millions of rows never sits in
    memory at once. The schema is inferred from the first chunk; every key must appear there (a key
    holding only None there has the null type) and every later row must fit it: a DataError names
    the first row that does not. A later chunk may leave keys out (they are null) and give integers
    where the schema has floats. The file appears complete or not at all (written to a temporary
    name, then renamed): after an error a file already at ``path`` is as it was.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    iterator = iter(rows)
    writer: pq.ParquetWriter | None = None
    schema: Optional[pa.Schema] = None
    count = 0
    try:
        while chunk := list(islice(iterator, chunk_rows)):
            table = _chunk_table(chunk, schema, count, target)
            if writer is None:
                schema = table.schema
                writer = pq.ParquetWriter(partial, schema)
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


def _chunk_table(chunk: list[Any], schema: Optional[pa.Schema], first_row: int, target: Path) -> pa.Table:
    """``chunk`` (rows ``first_row`` on) as a table of ``schema`` (None: the chunk's own, the first)."""
    for offset, row in enumerate(chunk):
        if not isinstance(row, Mapping):
            raise DataError(f"{target}: row {first_row + offset} is {_shown(row)}, expected a dict of column "
                            "values; nothing was written")
    try:
        inferred: Optional[pa.Table] = _inferred_table(chunk)
    except _CONVERSION_ERRORS:
        inferred = None
    if schema is None:
        if inferred is None:
            raise _first_chunk_error(chunk, first_row, target)
        return inferred
    if inferred is not None:
        if inferred.schema == schema:
            return inferred
        if _misfit(_as_struct(inferred.schema), _as_struct(schema)) is None:
            try:
                return pa.Table.from_pylist(chunk, schema=schema)
            except _CONVERSION_ERRORS:
                pass
    for offset, row in enumerate(chunk):
        error = _row_error(row, schema, first_row + offset, target)
        if error is not None:
            raise error
    raise DataError(f"{target}: rows {first_row}-{first_row + len(chunk) - 1} do not fit the schema of the first "
                    f"rows ({schema}); nothing was written")


def _as_struct(schema: pa.Schema) -> pa.StructType:
    return pa.struct(list(schema))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_list(data_type: pa.DataType) -> bool:
    return pa.types.is_list(data_type) or pa.types.is_large_list(data_type)


def _misfit(have: pa.DataType, want: pa.DataType, path: str = "",
            widen: bool = False) -> Optional[tuple[str, Optional[pa.DataType], pa.DataType]]:
    """The first key path where values of type ``have`` cannot be stored as ``want`` without loss:
    ``(path, want there or None for a key it lacks, have there)``; None when they fit. ``widen``: the
    types are of rows of the first chunk, which may add keys and widen types (null, int -> float)."""
    if have == want or pa.types.is_null(have) or (widen and pa.types.is_null(want)):
        return None
    if pa.types.is_struct(have) and pa.types.is_struct(want):
        for field in have:
            index = want.get_field_index(field.name)
            if index < 0:
                if widen:
                    continue
                return _join(path, field.name), None, field.type
            found = _misfit(field.type, want.field(index).type, _join(path, field.name), widen)
            if found is not None:
                return found
        return None
    if _is_list(have) and _is_list(want):
        return _misfit(have.value_type, want.value_type, f"{path}[]", widen)
    if pa.types.is_integer(have) and pa.types.is_floating(want):
        return None  # pyarrow refuses an integer that a float cannot hold exactly
    if widen and pa.types.is_floating(have) and pa.types.is_integer(want):
        return None
    return path, want, have


def _row_error(row: Mapping[str, Any], schema: pa.Schema, row_number: int, target: Path) -> Optional[DataError]:
    """The DataError for a row of a later chunk that does not fit ``schema`` (the first chunk's)."""
    own = _row_type(row, row_number, target)
    if isinstance(own, DataError):
        return own
    found = _misfit(own, _as_struct(schema))
    if found is not None:
        path, want, have = found
        if want is None:
            parent = path.rpartition(".")[0]
            keys = sorted(schema.names) if not parent else sorted(f.name for f in _type_at(schema, parent))
            return DataError(
                f"{target}: row {row_number}, key '{path}': not in the schema, which the first rows set (keys there: "
                f"{keys}); a key must appear in the first chunk of rows (write_parquet's chunk_rows): give it "
                "there, or raise chunk_rows; nothing was written")
        hint = " (the first rows held only None there: give one of them a value)" if pa.types.is_null(want) else ""
        return DataError(f"{target}: row {row_number}, key '{path}': {have} here, the schema has {want} from the "
                         f"first rows{hint}; give this key one type in every row; nothing was written")
    try:
        pa.Table.from_pylist([row], schema=schema)
    except _CONVERSION_ERRORS as exc:
        key = next((k for k in row if k in schema.names and not _converts([{k: row[k]}], pa.schema([schema.field(k)]))),
                   "?")
        return DataError(f"{target}: row {row_number}, key '{key}': does not fit the type "
                         f"{schema.field(key).type if key in schema.names else schema} of the first rows "
                         f"({type(exc).__name__}: {exc}); nothing was written")
    return None


def _row_type(row: Mapping[str, Any], row_number: int, target: Path) -> pa.StructType | DataError:
    """The type pyarrow infers for one row, or the DataError naming the key it cannot convert."""
    try:
        return _as_struct(_inferred_table([row]).schema)
    except _CONVERSION_ERRORS as exc:
        key = next((k for k in row if not _converts([{k: row[k]}])), "?")
        return DataError(f"{target}: row {row_number}, key '{key}': {_shown(row.get(key))} cannot be stored in "
                         f"parquet ({type(exc).__name__}: {exc}); the items of a list, like the values of a key, "
                         "must share one type; nothing was written")


def _first_chunk_error(chunk: list[Mapping[str, Any]], first_row: int, target: Path) -> DataError:
    """The rows of the first chunk take no common schema: name the row that breaks it and where."""
    fits, breaks = 0, len(chunk)  # the first `fits` rows convert together, the first `breaks` do not
    while breaks - fits > 1:
        middle = (fits + breaks) // 2
        fits, breaks = (middle, breaks) if _converts(chunk[:middle]) else (fits, middle)
    row_number = first_row + fits
    own = _row_type(chunk[fits], row_number, target)
    if isinstance(own, DataError):
        return own
    before = _as_struct(_inferred_table(chunk[:fits]).schema) if fits else pa.struct([])
    found = _misfit(own, before, widen=True)
    where = f"key '{found[0]}': {found[2]} here, {found[1]} in rows {first_row}-{row_number - 1}" if found \
        else "its values take no common type with the rows before"
    return DataError(f"{target}: row {row_number}, {where}; give each key one type in every row; nothing was written")


def _inferred_table(rows: list[Mapping[str, Any]]) -> pa.Table:
    """``rows`` with the types pyarrow infers, a column for every key of any row (``Table.from_pylist``
    takes its columns from the first row only)."""
    return pa.Table.from_batches([pa.RecordBatch.from_struct_array(pa.array(rows))])


def _converts(rows: list[Mapping[str, Any]], schema: Optional[pa.Schema] = None) -> bool:
    try:
        _inferred_table(rows) if schema is None else pa.Table.from_pylist(rows, schema=schema)
    except _CONVERSION_ERRORS:
        return False
    return True


def _type_at(schema: pa.Schema, path: str) -> pa.DataType:
    """The type at ``path`` (``a.b``, ``a[].b``) of ``schema``."""
    data_type: pa.DataType = _as_struct(schema)
    for part in path.split("."):
        data_type = data_type.field(part.split("[]")[0]).type
        for _ in range(part.count("[]")):
            data_type = data_type.value_type
    return data_type


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
