"""Chunked parquet writing: content preserved, all-or-nothing files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from data_helpers import row

from megarl.data.parquet_io import write_parquet

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
