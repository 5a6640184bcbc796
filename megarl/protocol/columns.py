"""Column checks for `Batch`: column types and lengths, equality of columns, row indices, meta.

A batch has two kinds of columns, both with B rows:
- tensor columns: `torch.Tensor` of shape (B, ...), any trailing shape and dtype;
- object columns: 1-D `numpy.ndarray` of dtype=object and shape (B,), one Python value per row.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch
from tensordict import TensorDict

from megarl.errors import DataError, MegarlError

if TYPE_CHECKING:
    from megarl.protocol.batch import Batch

# What `Batch.__getitem__` accepts to pick rows (a `str` picks a column instead).
RowIndex = Union[int, slice, torch.Tensor, np.ndarray, Sequence[int], Sequence[bool]]


class MissingKeyError(MegarlError, KeyError):
    """A column name that the batch does not have. The message lists the names it does have."""

    def __str__(self) -> str:
        # KeyError's own __str__ quotes the message as a repr; show it as written.
        return str(self.args[0]) if self.args else ""


def missing_key(key: object, available: Iterable[str]) -> MissingKeyError:
    return MissingKeyError(f"key {key!r} is not in the batch; available keys: {sorted(available)}")


def as_object_column(key: str, values: Any) -> np.ndarray:
    """Return `values` (a sequence or a 1-D numpy array) as a numpy object array of shape (len,).

    Lists inside `values` stay single elements (np.array would turn equal-length lists into a 2-D
    array). A 1-D object array is returned as is, without a copy.
    """
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise DataError(
                f"non-tensor column {key!r} must be 1-D with one value per row; got shape "
                f"{values.shape}. Put numeric arrays in tensors, or wrap each row in a list."
            )
        return values if values.dtype == object else values.astype(object)
    if isinstance(values, torch.Tensor):
        raise DataError(f"non-tensor column {key!r} is a torch.Tensor; pass it among the tensors")
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise DataError(
            f"non-tensor column {key!r} must be a list or 1-D numpy array with one value per row; "
            f"got {type(values).__name__}"
        )
    return np.fromiter(values, dtype=object, count=len(values))


def tensor_mismatch(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Describe how two tensor columns differ (None when equal: same dtype, shape and values).

    NaN equals NaN here, so a column holding NaNs equals itself.
    """
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a is b or a.numel() == 0:
        return None
    b = b.to(a.device)
    same = a == b
    if a.is_floating_point() or a.is_complex():
        same |= torch.isnan(a) & torch.isnan(b)
    if bool(same.all()):
        return None
    row = int(same.reshape(len(a), -1).all(dim=1).logical_not().nonzero()[0, 0])
    return f"values differ first at row {row}"


def object_mismatch_row(a: np.ndarray, b: np.ndarray) -> int | None:
    """First row where two object columns of equal length differ, or None when all rows are equal."""
    if a is b:
        return None
    try:
        # Fast path in C; elements such as numpy arrays make it raise or return a non-array.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            same = a == b
        if isinstance(same, np.ndarray) and same.shape == a.shape and bool(same.all()):
            return None
    except (ValueError, TypeError):
        pass
    for row, (x, y) in enumerate(zip(a, b)):
        if not objects_equal(x, y):
            return row
    return None


def objects_equal(x: Any, y: Any) -> bool:
    """Python equality that also works for numpy arrays and tensors nested in lists and dicts."""
    if x is y:
        return True
    if isinstance(x, (np.ndarray, torch.Tensor)) or isinstance(y, (np.ndarray, torch.Tensor)):
        if type(x) is not type(y) or x.shape != y.shape or x.dtype != y.dtype:
            return False
        if isinstance(x, torch.Tensor):
            return tensor_mismatch(x, y) is None
        return bool(np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(objects_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return (
            type(x) is type(y)
            and len(x) == len(y)
            and all(objects_equal(u, v) for u, v in zip(x, y))
        )
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    try:
        return bool(x == y)
    except (ValueError, TypeError):
        return False


def normalize_row_index(index: RowIndex, batch_size: int) -> slice | torch.Tensor:
    """Turn a row index into a step-1 slice (rows stay views) or an int64 CPU tensor of rows in [0, B).

    Accepts an int (negative counts from the end), a slice, an integer or boolean torch tensor or
    numpy array, or a list of ints or bools. Raises IndexError for rows outside [-B, B) and for a
    boolean mask whose length is not B.
    """
    if isinstance(index, (bool, np.bool_)):
        raise TypeError("a single bool is not a row index; use a boolean mask with one entry per row")
    if isinstance(index, (int, np.integer)):
        row = int(index)
        if not -batch_size <= row < batch_size:
            raise IndexError(f"row {row} is out of range for a batch of {batch_size} rows")
        row %= batch_size
        return slice(row, row + 1)
    if isinstance(index, slice):
        start, stop, step = index.indices(batch_size)
        if step == 1:
            return slice(start, max(start, stop))
        # torch has no negative-step views; strided slices become explicit rows.
        return torch.arange(start, stop, step, dtype=torch.int64)
    if isinstance(index, torch.Tensor):
        rows = index.detach().cpu()
    elif isinstance(index, np.ndarray):
        rows = torch.from_numpy(np.ascontiguousarray(index))
    elif isinstance(index, Sequence) and not isinstance(index, (str, bytes)):
        as_array = np.asarray(index)
        if len(index) == 0:
            as_array = as_array.astype(np.int64)
        rows = torch.from_numpy(as_array)
    else:
        raise TypeError(
            f"cannot index a batch with {type(index).__name__}; use a column name (str), an int, "
            "a slice, a list/array/tensor of row numbers, or a boolean mask"
        )
    if rows.dtype == torch.bool:
        if rows.shape != (batch_size,):
            raise IndexError(
                f"boolean mask has shape {tuple(rows.shape)} but the batch has {batch_size} rows"
            )
        return rows.nonzero().reshape(-1)
    if rows.is_floating_point() or rows.is_complex():
        raise TypeError(f"row indices must be integers or booleans, got dtype {rows.dtype}")
    if rows.ndim != 1:
        if rows.ndim == 0:
            return normalize_row_index(int(rows), batch_size)
        raise IndexError(f"row indices must be 1-D, got shape {tuple(rows.shape)}")
    rows = rows.to(torch.int64)
    if len(rows) and (int(rows.min()) < -batch_size or int(rows.max()) >= batch_size):
        bad = rows[(rows < -batch_size) | (rows >= batch_size)][0]
        raise IndexError(f"row {int(bad)} is out of range for a batch of {batch_size} rows")
    return torch.where(rows < 0, rows + batch_size, rows)


def checked_key(key: object) -> str:
    if not isinstance(key, str):
        raise DataError(f"column and meta names must be str, got {key!r} ({type(key).__name__})")
    return key


def tensor_columns(tensors: Mapping[str, torch.Tensor] | TensorDict | None) -> dict[str, torch.Tensor]:
    """Plain dict of the tensor columns, each checked to be a tensor with a batch dim."""
    columns: dict[str, torch.Tensor] = {}
    for key, tensor in (tensors.items() if tensors is not None else ()):
        checked_key(key)
        if not isinstance(tensor, torch.Tensor):
            raise DataError(
                f"tensor column {key!r} is a {type(tensor).__name__}, not a torch.Tensor "
                "(nested TensorDicts are not supported; put Python values in non_tensors)"
            )
        if tensor.ndim == 0:
            raise DataError(f"tensor column {key!r} is a scalar; columns need a batch dim (B, ...)")
        columns[key] = tensor
    return columns


def batch_size_and_source(
    tensors: Any,
    checked_tensors: dict[str, torch.Tensor],
    checked_objects: dict[str, np.ndarray],
    batch_size: int | None,
) -> tuple[int, str]:
    """B and what set it (for error messages): `batch_size`, a TensorDict's size, the first column, or 0."""
    if batch_size is not None:
        return batch_size, "batch_size"
    if isinstance(tensors, TensorDict) and tensors.batch_dims >= 1:
        return int(tensors.batch_size[0]), "the TensorDict's batch_size"
    for key, column in (*checked_tensors.items(), *checked_objects.items()):
        return len(column), f"column {key!r}"
    return 0, "an empty batch"


def check_same_layout(first: Batch, other: Batch, position: int) -> None:
    """Raise DataError unless `other` (batch number `position`) has `first`'s columns and layouts."""
    for kind, mine, theirs in (
        ("tensor", first.tensor_keys, other.tensor_keys),
        ("non-tensor", first.non_tensor_keys, other.non_tensor_keys),
    ):
        if set(mine) != set(theirs):
            raise DataError(
                f"batch {position} has {kind} columns {sorted(theirs)} but batch 0 has {sorted(mine)} "
                f"(missing: {sorted(set(mine) - set(theirs))}, extra: {sorted(set(theirs) - set(mine))})"
            )
    for key, tensor in first.tensors.items():
        theirs = other.tensors[key]
        if theirs.dtype != tensor.dtype or theirs.shape[1:] != tensor.shape[1:]:
            raise DataError(
                f"column {key!r} is {theirs.dtype} (B, *{list(theirs.shape[1:])}) in batch {position} "
                f"but {tensor.dtype} (B, *{list(tensor.shape[1:])}) in batch 0"
            )


def merged_meta(metas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Union of several batches' meta; a key with two different values raises DataError."""
    merged: dict[str, Any] = {}
    for position, meta in enumerate(metas):
        for key, value in meta.items():
            if key in merged and not objects_equal(merged[key], value):
                raise DataError(
                    f"meta[{key!r}] conflicts: {merged[key]!r} in an earlier batch, {value!r} in batch {position}"
                )
            merged.setdefault(key, value)
    return merged
