"""Chunked parquet writing: content preserved, all-or-nothing files, and a row that does not fit
the schema of the first chunk named (row, key, type) instead of being dropped or converted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from data_helpers import row

from megarl.data.parquet_io import write_parquet
from megarl.errors import DataError

pytestmark = pytest.mark.unit


def test_many_chunks_round_trip(tmp_path: Path) -> None:
    rows = [row(f"{i}+1=", answer=str(i + 1), index=i) for i in range(25)]
    assert write_parquet(iter(rows), tmp_path / "sub" / "x.parquet", chunk_rows=10) == 25
    table = pq.read_table(tmp_path / "sub" / "x.parquet")
    assert table.to_pylist() == rows
    assert pq.ParquetFile(tmp_path / "sub" / "x.parquet").metadata.num_row_groups == 3


def test_no_partial_file_on_failure(tmp_path: Path) -> None:
    def failing() -> Iterator[dict]:
        for i in range(15):
            if i == 12:
                raise RuntimeError("generator broke")
            yield row(str(i))

    with pytest.raises(RuntimeError, match="generator broke"):
        write_parquet(failing(), tmp_path / "x.parquet", chunk_rows=5)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="no rows"):
        write_parquet([], tmp_path / "y.parquet")
    assert list(tmp_path.iterdir()) == []


def _earlier_file(path: Path) -> bytes:
    """An earlier file at ``path``, which a failed write must leave as it was."""
    write_parquet([row("0=")], path)
    return path.read_bytes()


@pytest.mark.parametrize(("extra", "key"), [({"ability": None, "level": 3}, "level"),
                                            ({"extra_info": {"split": "train", "index": 3, "difficulty": "hard"}},
                                             "extra_info.difficulty")],
                         ids=["column", "extra_info-key"])
def test_a_key_first_seen_in_a_later_chunk_is_an_error_naming_row_and_key(
    tmp_path: Path, extra: dict, key: str
) -> None:
    rows = [row(f"{i}=", index=i) for i in range(5)]
    rows[3].update(extra)
    target = tmp_path / "x.parquet"
    before = _earlier_file(target)
    with pytest.raises(DataError) as error:
        write_parquet(iter(rows), target, chunk_rows=2)
    assert str(error.value).startswith(f"{target}: row 3, key '{key}': not in the schema, which the first rows set")
    assert "raise chunk_rows" in str(error.value)
    assert target.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["x.parquet"]
    # In one chunk the key is kept, also when only a later row of it has the key.
    assert write_parquet(iter(rows), target, chunk_rows=5) == 5
    assert pq.read_table(target).to_pylist()[3] == {**rows[3], **extra}


@pytest.mark.parametrize(("value", "have", "want"), [("three", "string", "int64"), (3.5, "double", "int64")],
                         ids=["str-for-int", "float-for-int"])
def test_a_later_value_of_another_type_names_row_key_and_expected_type(
    tmp_path: Path, value: object, have: str, want: str
) -> None:
    rows = [row(f"{i}=", index=i) for i in range(5)]
    rows[3]["extra_info"]["index"] = value  # 3.5 would have been stored as 3
    target = tmp_path / "x.parquet"
    before = _earlier_file(target)
    with pytest.raises(DataError, match=rf"row 3, key 'extra_info.index': {have} here, the schema has {want} from "
                                        "the first rows"):
        write_parquet(iter(rows), target, chunk_rows=2)
    assert target.read_bytes() == before


def test_rows_of_the_first_chunk_that_disagree_name_the_row(tmp_path: Path) -> None:
    rows = [row("0=", index=0), row("1=", index=1), row("2=", index=2)]
    rows[2]["extra_info"]["index"] = "two"
    with pytest.raises(DataError, match=r"x.parquet: row 2, key 'extra_info.index': string here, int64 in rows 0-1"):
        write_parquet(iter(rows), tmp_path / "x.parquet")
    assert list(tmp_path.iterdir()) == []


def test_later_chunks_may_leave_keys_out_and_give_ints_for_floats(tmp_path: Path) -> None:
    rows = [{"score": 0.5, "info": {"a": 1, "b": "x"}}, {"score": 1.5, "info": {"a": 2, "b": "y"}},
            {"score": 2}, {"score": None, "info": {"b": "z"}}]
    assert write_parquet(iter(rows), tmp_path / "x.parquet", chunk_rows=2) == 4
    assert pq.read_table(tmp_path / "x.parquet").to_pylist()[2:] == [
        {"score": 2.0, "info": None}, {"score": None, "info": {"a": None, "b": "z"}}]
