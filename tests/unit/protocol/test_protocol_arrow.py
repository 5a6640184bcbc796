"""Batch <-> Arrow table and parquet file: exact round trips and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from protocol_asserts import assert_batches_equal

from megarl.errors import DataError
from megarl.protocol import Batch

pytestmark = pytest.mark.unit


def every_dtype_batch() -> Batch:
    generator = torch.Generator().manual_seed(0)
    special = torch.tensor([[float("nan"), float("inf")], [-0.0, -float("inf")], [1e-40, 3.5]])
    return Batch.from_dict(
        {
            "f64": torch.randn(3, generator=generator, dtype=torch.float64),
            "f32": torch.randn(3, 2, 4, generator=generator),
            "f16": torch.randn(3, 5, generator=generator).half(),
            "bf16": special.to(torch.bfloat16),
            "i64": torch.randint(-(2**62), 2**62, (3, 2), generator=generator),
            "i32": torch.tensor([[-(2**31)], [0], [2**31 - 1]], dtype=torch.int32),
            "i16": torch.tensor([1, -2, 3], dtype=torch.int16),
            "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
            "u8": torch.tensor([0, 128, 255], dtype=torch.uint8),
            "mask": torch.tensor([[True, False, True], [False, False, True], [True, True, True]]),
            "no_width": torch.zeros(3, 0, 2),
        },
        {
            "uid": ["a", "b", "c"],
            "score": [1.5, None, -2.0],
            "messages": [[{"role": "user", "content": "hi"}], [], [{"role": "user", "content": "yo"}]],
            "extra_info": [{"index": 0}, {"split": "test"}, {}],  # ragged dicts: pickled
            "numpy_ints": [np.int64(1), np.int64(2), np.int64(3)],  # numpy scalars keep their type
            "pairs": [(1, 2), (3, 4), (5, 6)],  # tuples stay tuples
        },
        {"step": 7, "temperature": 0.7, "tags": ["x", "y"], "nested": {"a": None}},
    )


def test_arrow_round_trip_is_exact() -> None:
    batch = every_dtype_batch()
    restored = Batch.from_arrow(batch.to_arrow())
    assert_batches_equal(restored, batch)
    assert restored.keys() == batch.keys()
    for key in batch.tensor_keys:
        assert restored[key].dtype == batch[key].dtype and restored[key].shape == batch[key].shape, key
    # bit-exact bfloat16, including NaN, infinities and -0.0
    assert torch.equal(restored["bf16"].view(torch.int16), batch["bf16"].view(torch.int16))
    assert type(restored["numpy_ints"][0]) is np.int64 and restored["pairs"][2] == (5, 6)


def test_arrow_columns_are_readable_without_megarl() -> None:
    table = every_dtype_batch().to_arrow()
    assert table.num_rows == 3
    assert table.schema.field("uid").type == pa.string()
    assert table.column("uid").to_pylist() == ["a", "b", "c"]
    assert table.column("i64").type == pa.list_(pa.int64(), 2)
    assert table.column("f32").to_pylist()[1] == every_dtype_batch()["f32"][1].reshape(-1).tolist()
    assert table.column("messages").to_pylist()[0] == [{"role": "user", "content": "hi"}]
    assert table.schema.field("extra_info").type == pa.large_binary()
    header = json.loads(table.schema.metadata[b"megarl.batch"])
    assert header["tensors"]["f32"] == {"dtype": "float32", "shape": [2, 4]}
    assert header["meta"]["tags"] == ["x", "y"]


@pytest.mark.parametrize("size", [0, 1])
def test_small_and_empty_batches_round_trip(size: int) -> None:
    batch = Batch.from_dict({"x": torch.zeros(size, 3, dtype=torch.bfloat16)}, {"u": ["a"] * size}, {"k": 1})
    assert_batches_equal(Batch.from_arrow(batch.to_arrow()), batch)


def test_batch_without_columns_keeps_its_size() -> None:
    batch = Batch(batch_size=3, meta={"k": "v"})
    restored = Batch.from_arrow(batch.to_arrow())
    assert len(restored) == 3 and restored.meta == {"k": "v"}


def test_parquet_round_trip(tmp_path: Path) -> None:
    batch = every_dtype_batch()
    path = tmp_path / "batch.parquet"
    batch.to_parquet(path)
    assert_batches_equal(Batch.from_parquet(path), batch)
    assert pq.read_table(path, columns=["uid"]).column("uid").to_pylist() == ["a", "b", "c"]


def test_parquet_without_batch_metadata_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["1+1="]}), path)
    with pytest.raises(DataError, match=r"parquet file .*prompts.parquet has no 'megarl.batch' schema metadata"):
        Batch.from_parquet(path)


def test_unsupported_dtype_names_the_column() -> None:
    batch = Batch.from_dict({"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(DataError, match=r"tensor column 'z' has dtype torch.complex64.*supported: \['bfloat16'"):
        batch.to_arrow()


@pytest.mark.parametrize(
    ("meta", "key"),
    [({"fn": print}, "fn"), ({"pair": (1, 2)}, "pair"), ({"ids": {1: "a"}}, "ids"), ({"arr": np.zeros(2)}, "arr")],
)
def test_meta_that_json_would_change_is_refused(meta: dict[str, object], key: str) -> None:
    with pytest.raises(DataError, match=rf"meta\['{key}'\] = .* does not survive JSON unchanged"):
        Batch(batch_size=1, meta=meta).to_arrow()


def test_damaged_tables_are_refused() -> None:
    table = Batch.from_dict({"x": torch.arange(4).reshape(2, 2)}, {"u": ["a", "b"]}).to_arrow()
    with pytest.raises(DataError, match=r"Arrow table lacks columns \['u'\] listed in its batch metadata"):
        Batch.from_arrow(table.drop_columns(["u"]))
    with pytest.raises(DataError, match=r"Arrow table has 1 rows but its metadata says 2"):
        Batch.from_arrow(table.slice(0, 1))
    nulls = pa.array([[1, 2], None], type=pa.list_(pa.int64(), 2))
    with pytest.raises(DataError, match=r"tensor column 'x' of Arrow table has 1 null rows"):
        Batch.from_arrow(table.set_column(0, "x", nulls))
    header = json.loads(table.schema.metadata[b"megarl.batch"])
    header["format_version"] = 99
    newer = table.replace_schema_metadata({b"megarl.batch": json.dumps(header)})
    with pytest.raises(DataError, match=r"batch format version 99; this megarl reads version 1"):
        Batch.from_arrow(newer)
    header["format_version"] = 1
    header["tensors"]["x"]["shape"] = [3]
    wrong_shape = table.replace_schema_metadata({b"megarl.batch": json.dumps(header)})
    with pytest.raises(DataError, match=r"tensor column 'x' of Arrow table holds 4 torch.int64 values; its metadata says shape \[2, 3\]"):
        Batch.from_arrow(wrong_shape)


def test_sliced_and_chunked_tables_decode() -> None:
    batch = Batch.from_dict({"x": torch.arange(12).reshape(6, 2)}, {"u": list("abcdef")})
    table = batch.to_arrow()
    # two record batches, the second one starting mid-way through the buffers
    rebuilt = pa.Table.from_batches(table.to_batches(max_chunksize=4))
    assert_batches_equal(Batch.from_arrow(rebuilt), batch)
