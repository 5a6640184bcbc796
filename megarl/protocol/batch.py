"""`Batch`: the rows of data that move between the driver and the workers.

A batch of B rows holds
- `tensors`: a `tensordict.TensorDict` with batch_size [B]; every tensor is (B, ...), trailing dims free;
- `non_tensors`: dict of numpy object arrays of shape (B,), one Python value per row (uid, ground truth);
- `meta`: dict of plain Python values that describe the whole batch; it is not split, every piece
  made from a batch gets a (shallow) copy.

Every operation returns a new `Batch` with its own column dicts, so adding or removing a column on
the result never changes the source. Row data is shared where that is free: `select`, `pop`, int and
slice indexing, `split`, `chunk` and `unpad` give views of the source tensors (write into them and
the source changes); indexing by rows (`b[idx]`, `repeat`, `reorder`, `pad_to_multiple`) copies tensors.
Object columns copy references only: repeated rows share the same Python objects. `clone()` copies all.
Pickling (how Ray ships a batch) writes only the rows of a view, not the storage it came from.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, overload

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tensordict import TensorDict

from megarl.errors import DataError
from megarl.protocol.arrow import decode_table, encode_table
from megarl.protocol.columns import (
    RowIndex,
    as_object_column,
    batch_size_and_source,
    check_same_layout,
    checked_key,
    merged_meta,
    missing_key,
    normalize_row_index,
    object_mismatch_row,
    tensor_columns,
    tensor_mismatch,
)
from megarl.protocol.grouping import balanced_partition, check_positive, chunk_sizes, group_ids


class Batch:
    """Tensor columns (B, ...), object columns (B,) and meta; see the module docstring."""

    __slots__ = ("tensors", "non_tensors", "meta")

    tensors: TensorDict
    non_tensors: dict[str, np.ndarray]
    meta: dict[str, Any]

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | TensorDict | None = None,
        non_tensors: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
        meta: Mapping[str, Any] | None = None,
        *,
        batch_size: int | None = None,
    ) -> None:
        """Check and store the columns; same as `Batch.from_dict`.

        B is `batch_size` when given, else the length of the first column (0 with no columns).
        Raises DataError naming the column whose length differs from B.
        """
        checked_tensors = tensor_columns(tensors)
        checked_objects = {
            checked_key(key): as_object_column(key, values) for key, values in (non_tensors or {}).items()
        }
        both = sorted(checked_tensors.keys() & checked_objects.keys())
        if both:
            raise DataError(f"columns {both} are given both as tensors and as non-tensors")
        size, source = batch_size_and_source(tensors, checked_tensors, checked_objects, batch_size)
        for key, column in (*checked_tensors.items(), *checked_objects.items()):
            if len(column) != size:
                raise DataError(f"column {key!r} has {len(column)} rows, but {source} has {size}")
        if meta is not None and not isinstance(meta, Mapping):
            raise DataError(f"meta must be a dict, got {type(meta).__name__}")
        device = tensors.device if isinstance(tensors, TensorDict) else None
        self.tensors = TensorDict(checked_tensors, batch_size=[size], device=device)
        self.non_tensors = checked_objects
        self.meta = {checked_key(key): value for key, value in (meta or {}).items()}

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | TensorDict | None = None,
        non_tensors: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Batch:
        """Batch from tensors (B, ...), non-tensor sequences of length B, and meta.

        Non-tensor columns become numpy object arrays (B,); a list per row stays one value.
        """
        return cls(tensors, non_tensors, meta)

    @classmethod
    def _new(cls, tensors: TensorDict, non_tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> Batch:
        """Wrap columns that are already consistent, without checks (internal fast path)."""
        batch = object.__new__(cls)
        batch.tensors, batch.non_tensors, batch.meta = tensors, non_tensors, meta
        return batch

    # ----- size and columns -------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    @property
    def batch_size(self) -> int:
        """B, the number of rows."""
        return len(self)

    @property
    def tensor_keys(self) -> list[str]:
        return list(self.tensors.keys())

    @property
    def non_tensor_keys(self) -> list[str]:
        return list(self.non_tensors)

    def keys(self) -> list[str]:
        """All column names: tensor columns first, then non-tensor columns."""
        return self.tensor_keys + self.non_tensor_keys

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (key in self.non_tensors or key in self.tensors.keys())

    def __iter__(self) -> NoReturn:
        raise TypeError("a Batch is not iterable: use batch.keys() for columns, batch.split(1) for rows")

    @overload
    def __getitem__(self, index: str) -> torch.Tensor | np.ndarray: ...

    @overload
    def __getitem__(self, index: RowIndex) -> Batch: ...

    def __getitem__(self, index: str | RowIndex) -> torch.Tensor | np.ndarray | Batch:
        """`b["key"]` is a column; an int, slice, index list/array/tensor or boolean mask picks rows.

        An int gives a batch of one row. Ints and slices give views; other indices copy.
        """
        if isinstance(index, str):
            if index in self.non_tensors:
                return self.non_tensors[index]
            if index in self.tensors.keys():
                return self.tensors[index]
            raise missing_key(index, self.keys())
        return self._take(normalize_row_index(index, len(self)))

    def __setitem__(self, key: str, value: torch.Tensor | Sequence[Any] | np.ndarray) -> None:
        """Add or replace a column: a tensor (B, ...) or B Python values (stored as an object array)."""
        checked_key(key)
        if isinstance(value, torch.Tensor):
            if value.ndim == 0 or len(value) != len(self):
                shape = tuple(value.shape)
                raise DataError(f"column {key!r} has shape {shape}, but the batch has {len(self)} rows")
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
            return
        column = as_object_column(key, value)
        if len(column) != len(self):
            raise DataError(f"column {key!r} has {len(column)} rows, but the batch has {len(self)}")
        if key in self.tensors.keys():
            del self.tensors[key]
        self.non_tensors[key] = column

    def _check_keys(self, keys: Sequence[str]) -> None:
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(f"column names are str, got {key!r}; pass names as separate arguments")
            if key not in self:
                raise missing_key(key, self.keys())

    def select(self, *keys: str) -> Batch:
        """Batch with only the named columns (tensor or non-tensor) and a copy of meta; views."""
        self._check_keys(keys)
        tensor_keys = [key for key in keys if key not in self.non_tensors]
        non_tensors = {key: self.non_tensors[key] for key in keys if key in self.non_tensors}
        return Batch._new(self.tensors.select(*tensor_keys), non_tensors, dict(self.meta))

    def pop(self, *keys: str) -> Batch:
        """Remove the named columns from this batch and return them as a batch (with a copy of meta).

        Nothing is removed when any key is missing.
        """
        popped = self.select(*keys)
        for key in keys:
            if key in self.non_tensors:
                del self.non_tensors[key]
            elif key in self.tensors.keys():
                del self.tensors[key]
        return popped

    def union(self, other: Batch) -> Batch:
        """Batch with the columns and meta of both; columns and meta keys they share must be equal."""
        if len(self) != len(other):
            raise DataError(f"cannot union batches of {len(self)} and {len(other)} rows")
        tensors = dict(self.tensors.items())
        for key, column in other.tensors.items():
            if key in self.non_tensors:
                raise DataError(f"column {key!r} is a non-tensor in this batch but a tensor in the other")
            difference = tensor_mismatch(tensors[key], column) if key in tensors else None
            if difference:
                raise DataError(f"column {key!r} differs between the batches ({difference}); union "
                                "needs shared columns to be equal")
            tensors.setdefault(key, column)
        non_tensors = dict(self.non_tensors)
        for key, values in other.non_tensors.items():
            if key in tensors:
                raise DataError(f"column {key!r} is a tensor in this batch but a non-tensor in the other")
            row = object_mismatch_row(non_tensors[key], values) if key in non_tensors else None
            if row is not None:
                raise DataError(f"column {key!r} differs between the batches at row {row} "
                                f"({non_tensors[key][row]!r} vs {values[row]!r})")
            non_tensors.setdefault(key, values)
        meta = merged_meta([self.meta, other.meta])
        same_device = self.tensors.device == other.tensors.device
        device = self.tensors.device if same_device else None
        return Batch._new(TensorDict(tensors, batch_size=[len(self)], device=device), non_tensors, meta)

    # ----- rows ----------------------------------------------------------------------------------

    def _take(self, rows: slice | torch.Tensor) -> Batch:
        """Rows by a step-1 slice (views) or by an int64 CPU tensor of row numbers in [0, B) (copies)."""
        np_rows = rows if isinstance(rows, slice) else rows.numpy()
        non_tensors = {key: values[np_rows] for key, values in self.non_tensors.items()}
        return Batch._new(self.tensors[rows], non_tensors, dict(self.meta))

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of `size` rows (views); the last one may be smaller. B=0 gives []."""
        check_positive("split size", size)
        return [self._take(slice(start, start + size)) for start in range(0, len(self), size)]

    def chunk(self, k: int, allow_empty: bool = False) -> list[Batch]:
        """k consecutive pieces (views) whose sizes differ by at most one, larger pieces first.

        k > B raises ValueError unless `allow_empty`, which then gives k - B empty pieces.
        """
        bounds = np.cumsum([0, *chunk_sizes(len(self), k, allow_empty)]).tolist()
        return [self._take(slice(start, stop)) for start, stop in zip(bounds, bounds[1:])]

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order. All must have the same columns, dtypes and trailing shapes.

        Meta is merged: the first batch's, plus keys only later batches have; a key with two
        different values raises DataError.
        """
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        for position, batch in enumerate(batches[1:], start=1):
            check_same_layout(first, batch, position)
        tensors = {key: torch.cat([batch.tensors[key] for batch in batches]) for key in first.tensor_keys}
        non_tensors = {
            key: np.concatenate([batch.non_tensors[key] for batch in batches]) for key in first.non_tensors
        }
        meta = merged_meta([batch.meta for batch in batches])
        total = sum(len(batch) for batch in batches)
        devices = {batch.tensors.device for batch in batches}
        device = devices.pop() if len(devices) == 1 else None
        return cls._new(TensorDict(tensors, batch_size=[total], device=device), non_tensors, meta)

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row n times: interleaved [a, a, b, b] or tiled [a, b, a, b]. Returns n*B rows."""
        check_positive("repeat count", n)
        # Block copies per column; gathering by a row index is several times slower on big tensors.
        if interleave:
            tensors = {key: t.repeat_interleave(n, dim=0) for key, t in self.tensors.items()}
            non_tensors = {key: np.repeat(values, n) for key, values in self.non_tensors.items()}
        else:
            tensors = {key: t.repeat(n, *[1] * (t.ndim - 1)) for key, t in self.tensors.items()}
            non_tensors = {key: np.tile(values, n) for key, values in self.non_tensors.items()}
        table = TensorDict(tensors, batch_size=[n * len(self)], device=self.tensors.device)
        return Batch._new(table, non_tensors, dict(self.meta))

    def reorder(self, permutation: torch.Tensor | np.ndarray | Sequence[int]) -> Batch:
        """New batch whose row i is row permutation[i] of this one. This batch is left unchanged.

        permutation must hold every row number in [0, B) exactly once.
        """
        rows = normalize_row_index(permutation, len(self))
        if isinstance(rows, slice) or len(rows) != len(self):
            got = 1 if isinstance(rows, slice) else len(rows)
            raise ValueError(f"reorder needs a permutation of {len(self)} rows, got {got} indices")
        counts = torch.bincount(rows, minlength=len(self))
        if len(self) and int(counts.max()) > 1:
            row = int((counts > 1).nonzero()[0, 0])
            raise ValueError(f"reorder needs a permutation, but row {row} appears {int(counts[row])} times")
        return self._take(rows)

    def pad_to_multiple(self, k: int) -> tuple[Batch, int]:
        """(batch with a multiple of k rows, number of rows added).

        Added rows repeat rows from the start (0, 1, ...), so they hold valid data; drop them with
        `unpad`. With nothing to add the result is a view of this batch.
        """
        check_positive("pad multiple", k)
        pad = -len(self) % k
        if pad == 0:
            return self._take(slice(0, len(self))), 0
        rows = torch.cat([torch.arange(len(self)), torch.arange(pad) % len(self)])
        return self._take(rows), pad

    def unpad(self, pad: int) -> Batch:
        """The batch without its last `pad` rows (views): undoes `pad_to_multiple`."""
        if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad <= len(self):
            raise ValueError(f"pad must be an int in [0, {len(self)}], got {pad!r}")
        return self._take(slice(0, len(self) - pad))

    def group_indices(self, key: str = "uid") -> torch.Tensor:
        """int64 (B,) group id per row: rows with equal `key` share an id, numbered by first appearance."""
        return group_ids(self[key], key)

    def balance_by(self, lengths: str | torch.Tensor, k: int) -> tuple[Batch, torch.Tensor]:
        """Reorder rows so that `chunk(k)` gives pieces with close total lengths, e.g. DP shards.

        lengths: a tensor column name or a (B,) tensor of per-row work (tokens); a 2-D column such
        as attention_mask counts its row sums. Returns (balanced batch, order) with
        balanced = self[order]; rows keep their relative order within each piece.
        """
        work = self[lengths] if isinstance(lengths, str) else lengths
        if not isinstance(work, torch.Tensor) or work.ndim not in (1, 2) or len(work) != len(self):
            raise DataError(f"balance_by needs a tensor (B,) or (B, T) with B={len(self)}, got "
                            f"{type(work).__name__} of shape {getattr(work, 'shape', None)}")
        work = work.sum(dim=1) if work.ndim == 2 else work
        order = torch.cat(balanced_partition(work, chunk_sizes(len(self), k, allow_empty=False)))
        return self._take(order), order

    # ----- copies, devices, storage ---------------------------------------------------------------

    def to(self, device: torch.device | str) -> Batch:
        """The batch with its tensors on `device` (non-tensor columns are shared)."""
        return Batch._new(self.tensors.to(device), dict(self.non_tensors), dict(self.meta))

    def clone(self) -> Batch:
        """Deep copy: tensors, the objects in non-tensor columns and meta are all copied."""
        return Batch._new(self.tensors.clone(), copy.deepcopy(self.non_tensors), copy.deepcopy(self.meta))

    def to_arrow(self) -> pa.Table:
        """Arrow table that `Batch.from_arrow` turns back into an equal batch (dtypes and shapes too)."""
        return encode_table(dict(self.tensors.items()), self.non_tensors, self.meta, len(self))

    @classmethod
    def from_arrow(cls, table: pa.Table) -> Batch:
        """Batch from a table written by `to_arrow`. Pickled object columns are unpickled: trust it."""
        tensors, non_tensors, meta, size = decode_table(table)
        return cls(tensors, non_tensors, meta, batch_size=size)

    def to_parquet(self, path: str | os.PathLike[str]) -> None:
        """Write the batch to a parquet file (the `to_arrow` table)."""
        pq.write_table(self.to_arrow(), path)

    @classmethod
    def from_parquet(cls, path: str | os.PathLike[str]) -> Batch:
        """Batch from a parquet file written by `to_parquet`. Only load files you trust (pickle)."""
        tensors, non_tensors, meta, size = decode_table(pq.read_table(path), source=f"parquet file {path}")
        return cls(tensors, non_tensors, meta, batch_size=size)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "batch_size": len(self),
            "device": self.tensors.device,
            "tensors": {key: _to_pickled(tensor) for key, tensor in self.tensors.items()},
            "non_tensors": self.non_tensors,
            "meta": self.meta,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        tensors = {key: _from_pickled(value) for key, value in state["tensors"].items()}
        self.tensors = TensorDict(tensors, batch_size=[state["batch_size"]], device=state["device"])
        self.non_tensors = state["non_tensors"]
        self.meta = state["meta"]

    def __repr__(self) -> str:
        tensors = ", ".join(
            f"{key}: {str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
            for key, tensor in self.tensors.items()
        )
        non_tensors = ", ".join(f"{key}: object[{len(values)}]" for key, values in self.non_tensors.items())
        device = "" if self.tensors.device is None else f", device={self.tensors.device}"
        return (
            f"Batch(batch_size={len(self)}{device},\n"
            f"  tensors={{{tensors}}},\n"
            f"  non_tensors={{{non_tensors}}},\n"
            f"  meta keys={list(self.meta)})"
        )


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor alone, when it is a view into a larger storage (pickle would write all of it)."""
    needed = tensor.numel() * tensor.element_size()
    return tensor.clone() if tensor.untyped_storage().nbytes() > needed else tensor


# Host tensors are pickled as numpy arrays: numpy's protocol-5 pickling hands its buffer over
# without copying (Ray's serializer takes it out of band), where a torch tensor goes through
# torch.save's storage pickler: a quickstart update batch makes a Ray actor round trip 2.4x faster
# (benchmarks/batch_transfer.py). Dtypes numpy lacks (bfloat16, float8) travel as
# integers of the same width and are viewed back.
_NUMPY_CARRIER = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def _to_pickled(tensor: torch.Tensor) -> torch.Tensor | tuple[np.ndarray, torch.dtype]:
    """A tensor column as pickle should write it: (numpy array, dtype) for a host tensor, else the
    (compacted) tensor itself."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_conj() or tensor.is_neg():
        return _compact(tensor)
    data = tensor.detach()
    carrier = _NUMPY_CARRIER.get(data.dtype)
    if carrier is not None:
        data = data.contiguous().view(carrier)
    try:
        array = data.numpy()
    except TypeError:  # a dtype numpy cannot hold and no carrier is known for
        return _compact(tensor)
    # A view's array pickles its own elements only (numpy copies a non-contiguous one).
    return array, tensor.dtype


def _from_pickled(value: torch.Tensor | tuple[np.ndarray, torch.dtype]) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    array, dtype = value
    # Arrays unpickled from a read-only buffer (Ray's object store) are copied: batch tensors may
    # be written in place.
    tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
    return tensor.view(dtype) if tensor.dtype != dtype else tensor
