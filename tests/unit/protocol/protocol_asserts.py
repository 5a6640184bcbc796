"""Test helpers for megarl.protocol: batch equality written independently of the code under test."""

from __future__ import annotations

import numpy as np
import torch

from megarl.protocol import Batch


def assert_batches_equal(actual: Batch, expected: Batch) -> None:
    """Same rows, same columns (names, dtypes, shapes, values; NaN equals NaN) and equal meta."""
    assert len(actual) == len(expected)
    assert sorted(actual.tensors.keys()) == sorted(expected.tensors.keys())
    assert sorted(actual.non_tensors) == sorted(expected.non_tensors)
    for key in expected.tensors.keys():
        torch.testing.assert_close(actual.tensors[key], expected.tensors[key], rtol=0, atol=0, equal_nan=True)
    for key, values in expected.non_tensors.items():
        got = actual.non_tensors[key]
        assert isinstance(got, np.ndarray) and got.dtype == object and got.shape == (len(expected),), key
        for row in range(len(values)):
            assert type(got[row]) is type(values[row]) and got[row] == values[row], (key, row)
    assert actual.meta == expected.meta


def row_of(batch: Batch, row: int) -> dict[str, object]:
    """One row as plain Python values, for comparing rows across batches."""
    out: dict[str, object] = {key: batch.tensors[key][row].tolist() for key in batch.tensors.keys()}
    out.update({key: values[row] for key, values in batch.non_tensors.items()})
    return out
