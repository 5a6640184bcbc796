"""Row operations: indexing, split/chunk/concat, repeat, reorder, padding, grouping, balance, pickle."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from protocol_asserts import assert_batches_equal, row_of

from megarl.errors import DataError
from megarl.protocol import Batch

pytestmark = pytest.mark.unit


def rows_batch(size: int = 5) -> Batch:
    """Row r holds r in every column, so results can be read back as row numbers."""
    return Batch.from_dict(
        {"row": torch.arange(size), "pair": torch.arange(size * 2, dtype=torch.float32).reshape(size, 2)},
        {"name": [f"r{r}" for r in range(size)]},
        {"step": 1},
    )


def rows(batch: Batch) -> list[int]:
    return batch["row"].tolist()


# ----- indexing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        (2, [2]),
        (-1, [4]),
        (np.int64(3), [3]),
        (slice(1, 3), [1, 2]),
        (slice(None, None, -2), [4, 2, 0]),
        (slice(3, 1), []),
        (torch.tensor([4, 0, 0]), [4, 0, 0]),
        (torch.tensor([-1, 1], dtype=torch.int32), [4, 1]),
        (torch.tensor(2), [2]),
        (np.array([3, 1]), [3, 1]),
        ([2, 2], [2, 2]),
        ([], []),
        (torch.tensor([True, False, True, False, False]), [0, 2]),
        (np.array([False, False, False, True, True]), [3, 4]),
        ([True, True, False, False, False], [0, 1]),
    ],
)
def test_getitem_picks_rows(index: object, expected: list[int]) -> None:
    picked = rows_batch()[index]
    assert isinstance(picked, Batch)
    assert rows(picked) == expected
    assert picked["name"].tolist() == [f"r{r}" for r in expected]
    assert picked["pair"].tolist() == [[2.0 * r, 2.0 * r + 1] for r in expected]
    assert picked.meta == {"step": 1}


def test_int_and_slice_rows_are_views_index_rows_are_copies() -> None:
    batch = rows_batch()
    batch[1:3]["row"][0] = 100
    assert batch["row"][1] == 100
    batch[torch.tensor([2])]["row"][0] = -7
    assert batch["row"][2] == 2


@pytest.mark.parametrize(
    ("index", "error", "message"),
    [
        (5, IndexError, r"row 5 is out of range for a batch of 5 rows"),
        (-6, IndexError, r"row -6 is out of range for a batch of 5 rows"),
        (torch.tensor([0, 9]), IndexError, r"row 9 is out of range for a batch of 5 rows"),
        (torch.tensor([True, False]), IndexError, r"boolean mask has shape \(2,\) but the batch has 5 rows"),
        (torch.tensor([[0, 1]]), IndexError, r"row indices must be 1-D, got shape \(1, 2\)"),
        (torch.tensor([0.0]), TypeError, r"row indices must be integers or booleans, got dtype torch.float32"),
        (True, TypeError, r"a single bool is not a row index"),
        (1.5, TypeError, r"cannot index a batch with float"),
    ],
)
def test_bad_row_indices(index: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        rows_batch()[index]


# ----- split, chunk, concat -------------------------------------------------------------------


def test_split_last_piece_smaller() -> None:
    pieces = rows_batch(7).split(3)
    assert [rows(piece) for piece in pieces] == [[0, 1, 2], [3, 4, 5], [6]]
    assert all(piece.meta == {"step": 1} for piece in pieces)
    assert [rows(piece) for piece in rows_batch(3).split(5)] == [[0, 1, 2]]


def test_chunk_sizes_differ_by_at_most_one() -> None:
    assert [rows(piece) for piece in rows_batch(7).chunk(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(piece) for piece in rows_batch(3).chunk(5, allow_empty=True)] == [1, 1, 1, 0, 0]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda b: b.split(0), r"split size must be a positive int, got 0"),
        (lambda b: b.chunk(0), r"number of chunks must be a positive int, got 0"),
        (lambda b: b.chunk(6), r"cannot chunk 5 rows into 6 non-empty pieces; pass allow_empty=True to accept 1"),
        (lambda b: b.repeat(0), r"repeat count must be a positive int, got 0"),
        (lambda b: b.pad_to_multiple(0), r"pad multiple must be a positive int, got 0"),
        (lambda b: b.unpad(6), r"pad must be an int in \[0, 5\], got 6"),
        (lambda b: b.unpad(-1), r"pad must be an int in \[0, 5\], got -1"),
        (lambda b: b.reorder([0, 1, 2]), r"reorder needs a permutation of 5 rows, got 3 indices"),
        (lambda b: b.reorder([0, 1, 1, 3, 4]), r"reorder needs a permutation, but row 1 appears 2 times"),
        (lambda b: b.reorder(2), r"reorder needs a permutation of 5 rows, got 1 indices"),
    ],
)
def test_bad_row_operation_arguments(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(rows_batch())  # type: ignore[operator]


def test_concat_joins_rows_and_merges_meta() -> None:
    a, b = rows_batch(2), rows_batch(3)
    b.meta["extra"] = "x"
    joined = Batch.concat([a, b])
    assert rows(joined) == [0, 1, 0, 1, 2]
    assert joined["name"].tolist() == ["r0", "r1", "r0", "r1", "r2"] and joined["name"].dtype == object
    assert joined.meta == {"step": 1, "extra": "x"}


def test_concat_errors() -> None:
    with pytest.raises(ValueError, match=r"Batch.concat needs at least one batch"):
        Batch.concat([])
    other = rows_batch(2)
    other.pop("name")
    with pytest.raises(DataError, match=r"batch 1 has non-tensor columns \[\] but batch 0 has \['name'\] \(missing: \['name'\]"):
        Batch.concat([rows_batch(2), other])
    wide = rows_batch(2)
    wide["pair"] = torch.zeros(2, 3)
    with pytest.raises(DataError, match=r"column 'pair' is torch.float32 \(B, \*\[3\]\) in batch 1 but torch.float32 \(B, \*\[2\]\) in batch 0"):
        Batch.concat([rows_batch(2), wide])
    conflicting = rows_batch(2)
    conflicting.meta["step"] = 2
    with pytest.raises(DataError, match=r"meta\['step'\] conflicts: 1 in an earlier batch, 2 in batch 2"):
        Batch.concat([rows_batch(2), rows_batch(1), conflicting])


def test_empty_batches_split_chunk_concat_pad() -> None:
    empty = rows_batch(0)
    assert empty.split(4) == []
    assert [len(piece) for piece in empty.chunk(2, allow_empty=True)] == [0, 0]
    assert rows(Batch.concat([empty, rows_batch(2), empty])) == [0, 1]
    assert len(Batch.concat([empty, empty])) == 0
    padded, pad = empty.pad_to_multiple(4)
    assert (len(padded), pad) == (0, 0)
    assert len(empty.repeat(3)) == 0 and len(empty.reorder([])) == 0


# ----- repeat, reorder, padding ---------------------------------------------------------------


def test_repeat_interleaved_and_tiled() -> None:
    batch = rows_batch(3)
    assert rows(batch.repeat(2)) == [0, 0, 1, 1, 2, 2]
    assert batch.repeat(2)["name"].tolist() == ["r0", "r0", "r1", "r1", "r2", "r2"]
    assert rows(batch.repeat(2, interleave=False)) == [0, 1, 2, 0, 1, 2]
    assert batch.repeat(2, interleave=False)["pair"][4].tolist() == [2.0, 3.0]


def test_reorder_returns_a_new_batch() -> None:
    batch = rows_batch(4)
    reordered = batch.reorder(torch.tensor([2, 0, 3, 1]))
    assert rows(reordered) == [2, 0, 3, 1] and reordered["name"].tolist() == ["r2", "r0", "r3", "r1"]
    assert rows(batch) == [0, 1, 2, 3]


def test_pad_repeats_rows_from_the_start_and_unpad_drops_them() -> None:
    padded, pad = rows_batch(5).pad_to_multiple(4)
    assert pad == 3 and rows(padded) == [0, 1, 2, 3, 4, 0, 1, 2]
    assert padded["name"].tolist()[5:] == ["r0", "r1", "r2"]
    assert rows(padded.unpad(pad)) == [0, 1, 2, 3, 4]
    # fewer rows than the padding: cycle through them again
    padded, pad = rows_batch(2).pad_to_multiple(7)
    assert pad == 5 and rows(padded) == [0, 1, 0, 1, 0, 1, 0]
    unchanged, pad = rows_batch(4).pad_to_multiple(2)
    assert pad == 0 and rows(unchanged) == [0, 1, 2, 3]


# ----- grouping and balancing -----------------------------------------------------------------


def test_group_indices_number_groups_by_first_appearance() -> None:
    batch = Batch.from_dict({"tid": torch.tensor([7, 3, 7, 9, 3])}, {"uid": ["b", "a", "b", "c", "a"]})
    assert batch.group_indices().tolist() == [0, 1, 0, 2, 1]
    assert batch.group_indices("tid").tolist() == [0, 1, 0, 2, 1]
    assert batch.group_indices().dtype == torch.int64
    with pytest.raises(KeyError, match=r"key 'nope' is not in the batch"):
        batch.group_indices("nope")
    unhashable = Batch.from_dict(non_tensors={"u": [[1], [2]]})
    with pytest.raises(TypeError, match=r"cannot group by 'u': its values must be hashable"):
        unhashable.group_indices("u")
    with pytest.raises(ValueError, match=r"cannot group by 'm': it has shape \(5, 2\), need \(B,\)"):
        Batch.from_dict({"m": torch.zeros(5, 2)}).group_indices("m")
    assert Batch.from_dict({"t": torch.zeros(0)}).group_indices("t").tolist() == []


def test_group_indices_match_a_plain_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(0, 6, (40,), generator=generator)
    batch = Batch.from_dict({"t": values}, {"u": [f"u{v}" for v in values.tolist()]})
    seen: list[int] = []
    for value in values.tolist():
        if value not in seen:
            seen.append(value)
    expected = [seen.index(value) for value in values.tolist()]
    assert batch.group_indices("t").tolist() == expected
    assert batch.group_indices("u").tolist() == expected


def test_balance_by_hand_example() -> None:
    # lengths 9, 1, 1, 1, 8, 2 into 2 pieces of 3: greedy gives {9, 1, 1} = 11 and {8, 2, 1} = 11.
    batch = Batch.from_dict({"len": torch.tensor([9, 1, 1, 1, 8, 2]), "row": torch.arange(6)})
    balanced, order = batch.balance_by("len", 2)
    assert [rows(piece) for piece in balanced.chunk(2)] == [[0, 1, 2], [3, 4, 5]]
    assert torch.equal(balanced["row"], order)
    batch = Batch.from_dict({"len": torch.tensor([9, 8, 1, 1, 1, 2]), "row": torch.arange(6)})
    balanced, _ = batch.balance_by(batch["len"], 2)
    assert [piece["len"].sum().item() for piece in balanced.chunk(2)] == [11, 11]
    # row sums 3, 1, 2, 3: rows 0 and 3 open the pieces, row 2 joins piece 0 (tie), row 1 piece 1
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    balanced, order = Batch.from_dict({"attention_mask": mask}).balance_by("attention_mask", 2)
    assert order.tolist() == [0, 2, 1, 3]
    assert [piece["attention_mask"].sum().item() for piece in balanced.chunk(2)] == [5, 4]


def test_balance_by_is_near_optimal_on_small_cases() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        size, parts = int(rng.integers(1, 8)), int(rng.integers(1, 4))
        parts = min(parts, size)
        lengths = rng.integers(0, 30, size).tolist()
        batch = Batch.from_dict({"len": torch.tensor(lengths), "row": torch.arange(size)})
        balanced, order = batch.balance_by("len", parts)
        pieces = balanced.chunk(parts)
        assert sorted(order.tolist()) == list(range(size))
        loads = [sum(piece["len"].tolist()) for piece in pieces]
        best = min_max_load(lengths, [len(piece) for piece in pieces])
        assert max(loads) <= 1.5 * best, (lengths, loads, best)
        assert max(loads) - min(loads) <= max(lengths), (lengths, loads)


def min_max_load(lengths: list[int], sizes: list[int]) -> int:
    """Best possible largest piece load over all assignments with these piece sizes (brute force)."""
    best = sum(lengths)

    def place(row: int, counts: list[int], loads: list[int]) -> None:
        nonlocal best
        if row == len(lengths):
            best = min(best, max(loads))
            return
        for part, size in enumerate(sizes):
            if counts[part] < size and loads[part] + lengths[row] < best:
                counts[part] += 1
                loads[part] += lengths[row]
                place(row + 1, counts, loads)
                counts[part] -= 1
                loads[part] -= lengths[row]

    place(0, [0] * len(sizes), [0] * len(sizes))
    return best


def test_balance_by_errors() -> None:
    batch = rows_batch(4)
    with pytest.raises(DataError, match=r"balance_by needs a tensor \(B,\) or \(B, T\) with B=4, got ndarray"):
        batch.balance_by("name", 2)
    with pytest.raises(DataError, match=r"got Tensor of shape torch.Size\(\[3\]\)"):
        batch.balance_by(torch.ones(3), 2)
    with pytest.raises(ValueError, match=r"cannot chunk 4 rows into 5 non-empty pieces"):
        batch.balance_by("row", 5)


# ----- pickle ---------------------------------------------------------------------------------


def test_pickle_round_trip() -> None:
    batch = rows_batch(6)
    batch["bf16"] = torch.randn(6, 3).to(torch.bfloat16)
    assert_batches_equal(pickle.loads(pickle.dumps(batch)), batch)
    assert_batches_equal(pickle.loads(pickle.dumps(batch.to("cpu"))), batch)


ALL_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)


def dtype_batch() -> Batch:
    """A column of every dtype a batch may carry, as exact bit patterns (no rounding on the way)."""
    bits = torch.arange(6 * 4, dtype=torch.int64).reshape(6, 4) * 37 + 5
    columns = {}
    for dtype in ALL_DTYPES:
        width = torch.empty((), dtype=dtype).element_size()
        pattern = (bits % 2 ** (8 * width - 1)).to({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width])
        columns[str(dtype).removeprefix("torch.")] = pattern.view(dtype) if dtype != torch.bool else bits % 2 == 0
    return Batch.from_dict(columns, {"name": [f"r{r}" for r in range(6)]})


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    width = a.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def test_pickle_keeps_every_dtype_bit_for_bit() -> None:
    batch = dtype_batch()
    for piece in (batch, batch[1:4], batch[torch.tensor([5, 0, 2])]):
        restored = pickle.loads(pickle.dumps(piece))
        assert restored.keys() == piece.keys()
        assert list(restored["name"]) == list(piece["name"])
        for key in piece.tensor_keys:
            assert same_bits(restored[key], piece[key]), key


def test_pickle_of_strided_and_grad_columns() -> None:
    base = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    batch = Batch.from_dict({"strided": base[:, ::2], "transposed": base.t().contiguous().t(),
                             "grad": torch.ones(5, 2, requires_grad=True) * 3})
    restored = pickle.loads(pickle.dumps(batch))
    assert torch.equal(restored["strided"], base[:, ::2])
    assert torch.equal(restored["transposed"], base)
    assert torch.equal(restored["grad"], torch.full((5, 2), 3.0)) and not restored["grad"].requires_grad


def test_unpickled_from_read_only_buffers_is_writable_and_independent() -> None:
    """Ray hands large pickled buffers back read-only (its object store): the restored columns are
    copies that can be written in place without touching the buffer or the source."""
    batch = rows_batch(6)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    assert buffers  # the tensor columns went out of band
    frozen = [memoryview(bytes(buffer.raw())) for buffer in buffers]  # bytes: read-only
    restored = pickle.loads(data, buffers=frozen)
    restored["pair"].add_(100)
    restored["row"][0] = 99
    assert restored["pair"][0].tolist() == [100.0, 101.0] and restored["row"][0] == 99
    assert rows(batch) == [0, 1, 2, 3, 4, 5] and batch["pair"][0].tolist() == [0.0, 1.0]
    again = pickle.loads(data, buffers=frozen)
    assert rows(again) == [0, 1, 2, 3, 4, 5]


def test_pickled_view_carries_only_its_rows() -> None:
    big = Batch.from_dict({"x": torch.zeros(10_000, 100)})
    piece = big.chunk(100)[3]
    size = len(pickle.dumps(piece))
    assert size < 10_000 * 100 * 4 / 50, size  # one hundredth of the storage, plus overhead
    restored = pickle.loads(pickle.dumps(piece))
    assert_batches_equal(restored, piece)
    assert row_of(restored, 0) == row_of(big, 300)
