"""Bad rows in real parquet files: text that is not UTF-8, blank prompts and wrong types are errors
naming file, row and column; with skip_bad_rows they are left out, counted and logged."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_helpers import row, write_rows
from transformers import PreTrainedTokenizerBase

from megarl.config.schema import DataConfig
from megarl.data.dataset import RLDataset
from megarl.data.utf8 import non_utf8_rows
from megarl.errors import DataError

pytestmark = pytest.mark.unit

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
MESSAGES_AS_BYTES = pa.list_(pa.struct([("role", pa.binary()), ("content", pa.binary())]))
GROUND_TRUTH = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])


def write_raw(path: Path, prompts: list[bytes], *, chat: bool, sources: list[bytes] | None = None) -> str:
    """A parquet file whose string cells hold the given bytes unchecked (as a foreign writer may)."""
    if chat:
        cells = [[{"role": b"user", "content": p}] for p in prompts]
        prompt = pa.array(cells, type=MESSAGES_AS_BYTES).view(MESSAGES)
    else:
        prompt = pa.array(prompts, type=pa.binary()).view(pa.string())
    sources = sources or [b"arithmetic"] * len(prompts)
    table = pa.table({
        "data_source": pa.array(sources, type=pa.binary()).view(pa.string()),
        "prompt": prompt,
        "reward_model": pa.array([{"style": "rule", "ground_truth": "2"}] * len(prompts), type=GROUND_TRUTH),
    })
    pq.write_table(table, path)
    return str(path)


@pytest.mark.parametrize("chat", [False, True], ids=["string", "chat-messages"])
@pytest.mark.parametrize("measured", [True, False], ids=["length-pass", "on-fetch"])
def test_text_that_is_not_utf8_names_file_row_and_column(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str, chat: bool, measured: bool
) -> None:
    path = write_raw(tmp_path / "latin1.parquet", [b"1+1=", b"1+1=", "2+2= caf\u00e9".encode("latin-1")], chat=chat)
    assert list(non_utf8_rows(path))[0][:2] == (2, "prompt")
    with pytest.raises(DataError) as error:
        dataset = RLDataset(path, char_tokenizer, filter_overlong_prompts=measured, cache_dir=cache_dir)
        dataset.get_rows([0, 1, 2])
    assert f"{path}: row 2, column 'prompt': text is not valid UTF-8 (byte 0xe9 at position" in str(error.value)


def test_the_row_is_found_in_the_right_file_and_in_data_source(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    good = write_raw(tmp_path / "good.parquet", [b"1=", b"2="], chat=True)
    bad = write_raw(tmp_path / "bad.parquet", [b"1=", b"2=", b"3="], chat=True,
                    sources=[b"arithmetic", b"arith\xffmetic", b"arithmetic"])
    with pytest.raises(DataError, match=rf"{bad}: row 1, column 'data_source': text is not valid UTF-8 "
                                        r"\(byte 0xff at position 5"):
        RLDataset([good, bad], char_tokenizer, cache_dir=cache_dir)
    # Without the length pass the rows are not read at construction: asking for the sources is the
    # first read of that column.
    dataset = RLDataset([good, bad], char_tokenizer, filter_overlong_prompts=False, cache_dir=cache_dir)
    with pytest.raises(DataError, match=rf"{bad}: row 1, column 'data_source'"):
        dataset.data_sources()
    assert [r["row"] for r in dataset.get_rows([0, 1, 2])] == [0, 1, 2]  # clean rows still fetch


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("   ", "the prompt is a blank string"),
        ([{"role": "user", "content": ""}], "every message's 'content' is blank"),
        ([], "expected a non-empty list"),
    ],
    ids=["blank-string", "blank-content", "no-messages"],
)
def test_blank_and_mistyped_prompts_name_file_row_and_column(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str, prompt: Any, message: str
) -> None:
    rows = [row("1="), row("2=")]
    rows[1]["prompt"] = prompt
    if isinstance(prompt, str):
        rows[0]["prompt"] = "1="  # one type for the column
    path = str(tmp_path / "x.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=rf"{path}: row 1, column 'prompt': {message}"):
        RLDataset(path, char_tokenizer, cache_dir=cache_dir)


def test_a_prompt_column_of_numbers_names_the_row(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    path = str(tmp_path / "numbers.parquet")
    pq.write_table(pa.table({"data_source": ["arithmetic"], "prompt": [12],
                             "reward_model": [{"style": "rule", "ground_truth": "1"}]}), path)
    with pytest.raises(DataError, match=rf"{path}: row 0, column 'prompt': expected a non-empty list of chat "
                                        r"messages or a string, got int 12"):
        RLDataset(path, char_tokenizer, filter_overlong_prompts=False, cache_dir=cache_dir)[0]


def bad_mix(tmp_path: Path) -> str:
    """Rows: 0 good, 1 blank prompt, 2 no ground truth, 3 good, 4 overlong, 5 bad data_source, 6 good."""
    rows = [row("1=", "1"), row(" "), row("2="), row("3=", "3"), row("1234567890="), row("4="), row("5=", "5")]
    rows[1]["prompt"] = [{"role": "user", "content": " "}]
    rows[2]["reward_model"] = {"style": "rule", "ground_truth": None}
    rows[5]["data_source"] = ""
    return write_rows(tmp_path / "mix.parquet", rows)


def test_skip_bad_rows_leaves_them_out_counts_and_logs(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = bad_mix(tmp_path)
    with pytest.raises(DataError, match=rf"{path}: row 1, column 'prompt'"):
        RLDataset(path, char_tokenizer, max_prompt_length=6, cache_dir=cache_dir)
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        dataset = RLDataset(path, char_tokenizer, max_prompt_length=6, skip_bad_rows=True, cache_dir=cache_dir)
    assert dataset.num_skipped_bad_rows == 3 and dataset.num_dropped_overlong == 1
    assert [r["row"] for r in dataset.get_rows(range(len(dataset)))] == [0, 3, 6]
    assert [r["ground_truth"] for r in dataset.get_rows(range(len(dataset)))] == ["1", "3", "5"]
    assert dataset.data_sources() == ["arithmetic"]  # the skipped row's empty source is not asked for
    text = caplog.text
    assert "skipped 3 of 7 rows that fail their checks (data.skip_bad_rows)" in text
    assert f"{path}: row 1, column 'prompt'" in text and f"{path}: row 2, column 'reward_model'" in text
    # Without the overlong filter the long prompt stays; the bad rows are still skipped.
    kept = RLDataset(path, char_tokenizer, max_prompt_length=6, truncation="left",
                     filter_overlong_prompts=False, skip_bad_rows=True, cache_dir=cache_dir)
    assert [r["row"] for r in kept.get_rows(range(len(kept)))] == [0, 3, 4, 6] and kept.num_skipped_bad_rows == 3


def test_skip_bad_rows_skips_text_that_is_not_utf8_and_is_read_from_the_config(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_raw(tmp_path / "latin1.parquet", [b"1=", b"\xe9=", b"2=", b"\xff"], chat=True)
    config = DataConfig(max_prompt_length=8, skip_bad_rows=True)
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        dataset = RLDataset.from_config(config, [path], char_tokenizer, cache_dir=cache_dir)
    assert dataset.num_skipped_bad_rows == 2
    assert [r["row"] for r in dataset.get_rows(range(len(dataset)))] == [0, 2]
    assert f"{path}: row 1, column 'prompt': text is not valid UTF-8 (byte 0xe9" in caplog.text
    assert DataConfig().skip_bad_rows is False


def test_skipped_rows_are_named_by_their_row_in_the_file_after_a_non_utf8_row(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Rows: 0 good, 1 not UTF-8, 2 good, 3 no ground truth, 4 blank prompt, 5 good. The checks that
    follow the UTF-8 scan run over the rows left; their messages still give each row's number in the file."""
    prompts = [b"1=", b"\xe9=", b"2=", b"3=", b" ", b"5="]
    answers = ["1", "1", "2", None, "4", "5"]
    table = pa.table({
        "data_source": ["arithmetic"] * len(prompts),
        "prompt": pa.array([[{"role": b"user", "content": p}] for p in prompts], type=MESSAGES_AS_BYTES).view(MESSAGES),
        "reward_model": pa.array([{"style": "rule", "ground_truth": a} for a in answers], type=GROUND_TRUTH),
    })
    path = str(tmp_path / "mixed.parquet")
    pq.write_table(table, path)
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        dataset = RLDataset(path, char_tokenizer, max_prompt_length=8, skip_bad_rows=True, cache_dir=cache_dir)
    assert [r["row"] for r in dataset.get_rows(range(len(dataset)))] == [0, 2, 5]
    assert dataset.num_skipped_bad_rows == 3
    text = caplog.text
    assert "skipped 3 of 6 rows that fail their checks (data.skip_bad_rows)" in text
    assert f"{path}: row 1, column 'prompt': text is not valid UTF-8" in text
    assert f"{path}: row 3, column 'reward_model'" in text and "ground_truth" in text
    assert f"{path}: row 4, column 'prompt': every message's 'content' is blank" in text
    assert f"{path}: row 2," not in text  # the shifted numbers of rows 3 and 4
    # Without skip_bad_rows the first bad row is the error.
    with pytest.raises(DataError, match=rf"{path}: row 1, column 'prompt': text is not valid UTF-8"):
        RLDataset(path, char_tokenizer, max_prompt_length=8, cache_dir=cache_dir)
