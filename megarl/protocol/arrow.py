"""Arrow encoding of a batch's columns: exact round trips of tensors, object columns and meta.

Layout of the table written by `encode_table`:
- a tensor column of shape (B, *trailing) becomes one Arrow column: a primitive column when there
  are no trailing dims, else a fixed-size list of prod(trailing) values per row (row-major).
  bfloat16, which Arrow lacks, is stored as its uint16 bit pattern. The torch dtype and trailing
  shape are kept in the schema metadata, so decoding restores both exactly.
- an object column becomes a native Arrow column when every value survives the trip through Arrow
  with its exact Python type (str, int, float, bool, None, lists of those, ...); otherwise each value
  is pickled into a binary column. Decoding pickled columns runs pickle: load only trusted files.
- meta is stored as JSON in the schema metadata, so it must consist of JSON values.
"""

from __future__ import annotations

import json
import math
import pickle
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from megarl.errors import DataError

METADATA_KEY = b"megarl.batch"
FORMAT_VERSION = 1

# torch dtype name -> (torch dtype, the dtype whose bits are stored in Arrow)
_TENSOR_DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "float64": (torch.float64, torch.float64),
    "float32": (torch.float32, torch.float32),
    "float16": (torch.float16, torch.float16),
    "bfloat16": (torch.bfloat16, torch.uint16),
    "int64": (torch.int64, torch.int64),
    "int32": (torch.int32, torch.int32),
    "int16": (torch.int16, torch.int16),
    "int8": (torch.int8, torch.int8),
    "uint8": (torch.uint8, torch.uint8),
    "bool": (torch.bool, torch.bool),
}
_DTYPE_NAMES = {torch_dtype: name for name, (torch_dtype, _) in _TENSOR_DTYPES.items()}


def encode_table(
    tensors: dict[str, torch.Tensor],
    non_tensors: dict[str, np.ndarray],
    meta: dict[str, Any],
    batch_size: int,
) -> pa.Table:
    """Encode columns with B = `batch_size` rows into an Arrow table (see the module docstring)."""
    columns: dict[str, pa.Array] = {}
    tensor_info: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        columns[key], tensor_info[key] = _encode_tensor(key, tensor)
    encodings: dict[str, str] = {}
    for key, values in non_tensors.items():
        columns[key], encodings[key] = _encode_objects(values)
    header = {
        "format_version": FORMAT_VERSION,
        "batch_size": batch_size,
        "tensors": tensor_info,
        "non_tensors": encodings,
        "meta": _check_json_meta(meta),
    }
    table = pa.table(columns) if columns else pa.table({})
    return table.replace_schema_metadata({METADATA_KEY: json.dumps(header).encode()})


def decode_table(
    table: pa.Table, source: str = "Arrow table"
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray], dict[str, Any], int]:
    """Inverse of `encode_table`: (tensors, non_tensors, meta, batch_size).

    `source` names the table (e.g. a file path) in error messages.
    """
    metadata = table.schema.metadata or {}
    if METADATA_KEY not in metadata:
        raise DataError(
            f"{source} has no {METADATA_KEY.decode()!r} schema metadata, so it was not written by "
            "Batch.to_arrow/to_parquet; datasets of prompts are read by megarl.data instead"
        )
    header = json.loads(metadata[METADATA_KEY])
    if header.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{source} has batch format version {header.get('format_version')}; "
            f"this megarl reads version {FORMAT_VERSION}"
        )
    batch_size = int(header["batch_size"])
    expected = list(header["tensors"]) + list(header["non_tensors"])
    missing = [key for key in expected if key not in table.column_names]
    if missing:
        raise DataError(f"{source} lacks columns {missing} listed in its batch metadata")
    if expected and table.num_rows != batch_size:
        raise DataError(f"{source} has {table.num_rows} rows but its metadata says {batch_size}")
    tensors = {
        key: _decode_tensor(key, table.column(key), info, batch_size, source)
        for key, info in header["tensors"].items()
    }
    non_tensors = {
        key: _decode_objects(table.column(key), encoding)
        for key, encoding in header["non_tensors"].items()
    }
    return tensors, non_tensors, header["meta"], batch_size


def _encode_tensor(key: str, tensor: torch.Tensor) -> tuple[pa.Array, dict[str, Any]]:
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise DataError(
            f"tensor column {key!r} has dtype {tensor.dtype}, which Batch.to_arrow cannot store; "
            f"supported: {sorted(_TENSOR_DTYPES)}"
        )
    trailing = list(tensor.shape[1:])
    per_row = math.prod(trailing)
    info = {"dtype": name, "shape": trailing}
    if per_row == 0:
        # Arrow refuses fixed-size lists of length 0; the shape in the metadata suffices.
        return pa.nulls(len(tensor)), info
    stored = tensor.detach().cpu().contiguous().view(_TENSOR_DTYPES[name][1])
    values = pa.array(stored.reshape(-1).numpy())
    if not trailing:
        return values, info
    return pa.FixedSizeListArray.from_arrays(values, per_row), info


def _decode_tensor(
    key: str, column: pa.ChunkedArray, info: dict[str, Any], batch_size: int, source: str
) -> torch.Tensor:
    torch_dtype, stored_dtype = _TENSOR_DTYPES[info["dtype"]]
    shape = (batch_size, *info["shape"])
    if math.prod(info["shape"]) == 0:
        return torch.empty(shape, dtype=torch_dtype)
    array = column.combine_chunks()
    if pa.types.is_fixed_size_list(array.type):
        if array.null_count:
            raise DataError(f"tensor column {key!r} of {source} has {array.null_count} null rows")
        array = array.flatten()
    if array.null_count:
        raise DataError(f"tensor column {key!r} of {source} has {array.null_count} null values")
    values = torch.from_numpy(array.to_numpy(zero_copy_only=False, writable=True))
    if values.dtype != stored_dtype or values.numel() != math.prod(shape):
        raise DataError(
            f"tensor column {key!r} of {source} holds {values.numel()} {values.dtype} values; "
            f"its metadata says shape {list(shape)} of {info['dtype']}"
        )
    return values.view(torch_dtype).reshape(shape)


def _encode_objects(values: np.ndarray) -> tuple[pa.Array, str]:
    rows = values.tolist()
    try:
        native = pa.array(rows)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        native = None
    if native is not None and all(map(_same_value_and_type, rows, native.to_pylist())):
        return native, "arrow"
    return pa.array([pickle.dumps(row) for row in rows], type=pa.large_binary()), "pickle"


def _decode_objects(column: pa.ChunkedArray, encoding: str) -> np.ndarray:
    rows = column.to_pylist()
    if encoding == "pickle":
        rows = [pickle.loads(row) for row in rows]
    return np.fromiter(rows, dtype=object, count=len(rows))


def _same_value_and_type(x: Any, y: Any) -> bool:
    """Equality that also requires equal types at every level (1 vs 1.0, tuple vs list differ)."""
    if type(x) is not type(y):
        return False
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(map(_same_value_and_type, x, y))
    if isinstance(x, dict):
        return list(x) == list(y) and all(_same_value_and_type(x[k], y[k]) for k in x)
    if isinstance(x, float) and math.isnan(x):
        return math.isnan(y)
    return bool(x == y)


def _check_json_meta(meta: dict[str, Any]) -> dict[str, Any]:
    for key, value in meta.items():
        try:
            survives = _same_value_and_type(value, json.loads(json.dumps(value)))
        except (TypeError, ValueError):
            survives = False
        if not isinstance(key, str) or not survives:
            raise DataError(
                f"meta[{key!r}] = {value!r} does not survive JSON unchanged; Batch.to_arrow stores "
                "meta as JSON, so use str keys and str/int/float/bool/None/list/dict values"
            )
    return meta
