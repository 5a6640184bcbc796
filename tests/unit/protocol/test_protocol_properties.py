"""Property-based round trips of Batch operations on random batches (hypothesis)."""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_asserts import assert_batches_equal, row_of

from megarl.protocol import Batch

pytestmark = pytest.mark.unit

SETTINGS = settings(max_examples=50, deadline=None)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), st.text(max_size=5))
object_values = st.one_of(
    json_scalars,
    st.floats(allow_nan=False),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.sampled_from(["a", "b"]), st.integers(), max_size=2),
    st.tuples(st.integers(), st.text(max_size=2)),
)


def random_tensor(size: int, dtype: torch.dtype, trailing: list[int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (size, *trailing)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * 100).to(dtype)
    low, high = (0, 256) if dtype == torch.uint8 else (-(2**31), 2**31 - 1)
    return torch.randint(low, high, shape, generator=generator).to(dtype)


@st.composite
def batches(draw: st.DrawFn, min_size: int = 0, max_size: int = 12) -> Batch:
    """A batch with a `row` column (0..B-1), random tensor and object columns, and JSON meta."""
    size = draw(st.integers(min_size, max_size))
    tensors = {"row": torch.arange(size)}
    for number in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from(DTYPES))
        trailing = draw(st.lists(st.integers(0, 3), max_size=2))
        tensors[f"t{number}"] = random_tensor(size, dtype, trailing, draw(st.integers(0, 2**16)))
    non_tensors = {
        f"o{number}": draw(st.lists(object_values, min_size=size, max_size=size))
        for number in range(draw(st.integers(0, 2)))
    }
    meta = draw(st.dictionaries(st.sampled_from(["step", "note", "flags"]), json_scalars, max_size=2))
    return Batch.from_dict(tensors, non_tensors, meta)


def original_rows(batch: Batch) -> list[int]:
    return batch["row"].tolist()


@SETTINGS
@given(batches(min_size=1), st.integers(1, 15))
def test_split_then_concat_is_identity(batch: Batch, size: int) -> None:
    pieces = batch.split(size)
    assert [len(piece) for piece in pieces[:-1]] == [size] * (len(pieces) - 1)
    assert 1 <= len(pieces[-1]) <= size
    assert_batches_equal(Batch.concat(pieces), batch)


@SETTINGS
@given(batches(min_size=1), st.data())
def test_chunk_then_concat_is_identity(batch: Batch, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(batch)))
    pieces = batch.chunk(k)
    sizes = [len(piece) for piece in pieces]
    assert len(pieces) == k and sum(sizes) == len(batch) and max(sizes) - min(sizes) <= 1
    assert_batches_equal(Batch.concat(pieces), batch)


@SETTINGS
@given(batches(), st.integers(1, 9))
def test_pad_then_unpad_is_identity(batch: Batch, k: int) -> None:
    padded, pad = batch.pad_to_multiple(k)
    assert len(padded) % k == 0 and 0 <= pad < k and len(padded) == len(batch) + pad
    for position in range(len(padded)):  # padding rows repeat rows from the start
        assert original_rows(padded)[position] == position % len(batch)
    assert_batches_equal(padded.unpad(pad), batch)


@SETTINGS
@given(batches(), st.integers(1, 4), st.booleans())
def test_repeat_holds_n_copies_of_every_row(batch: Batch, n: int, interleave: bool) -> None:
    repeated = batch.repeat(n, interleave=interleave)
    assert len(repeated) == n * len(batch)
    sources = original_rows(repeated)
    for position, source in enumerate(sources):
        expected = position // n if interleave else position % len(batch)
        assert source == expected
        assert repeat_row_equal(row_of(repeated, position), row_of(batch, source))
    for source in range(len(batch)):
        assert sources.count(source) == n


def repeat_row_equal(a: dict[str, object], b: dict[str, object]) -> bool:
    # plain ==: the random floats of these batches are never NaN
    return a.keys() == b.keys() and all(a[key] == b[key] for key in a)


@SETTINGS
@given(batches(), st.randoms(use_true_random=False))
def test_reorder_then_inverse_is_identity(batch: Batch, random: object) -> None:
    permutation = list(range(len(batch)))
    random.shuffle(permutation)  # type: ignore[attr-defined]
    inverse = [0] * len(batch)
    for position, source in enumerate(permutation):
        inverse[source] = position
    reordered = batch.reorder(torch.tensor(permutation, dtype=torch.int64))
    assert original_rows(reordered) == permutation
    assert_batches_equal(reordered.reorder(inverse), batch)


@SETTINGS
@given(batches())
def test_arrow_round_trip(batch: Batch) -> None:
    assert_batches_equal(Batch.from_arrow(batch.to_arrow()), batch)


@settings(max_examples=10, deadline=None)
@given(batches())
def test_parquet_round_trip(batch: Batch) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "batch.parquet"
        batch.to_parquet(path)
        assert_batches_equal(Batch.from_parquet(path), batch)


@SETTINGS
@given(batches(), st.data())
def test_pickle_round_trip_of_batches_and_slices(batch: Batch, data: st.DataObject) -> None:
    assert_batches_equal(pickle.loads(pickle.dumps(batch)), batch)
    start = data.draw(st.integers(0, len(batch)))
    piece = batch[start:]
    assert_batches_equal(pickle.loads(pickle.dumps(piece)), piece)


@SETTINGS
@given(st.lists(st.sampled_from("abcde"), max_size=20))
def test_group_indices_match_first_appearance(uids: list[str]) -> None:
    groups = Batch.from_dict(non_tensors={"uid": uids}).group_indices().tolist()
    for row, uid in enumerate(uids):
        first_rows = [r for r in range(len(uids)) if uids[r] not in uids[:r]]
        assert groups[row] == [uids[r] for r in first_rows].index(uid)
