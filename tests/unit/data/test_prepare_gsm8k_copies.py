"""GSM8K from the local copies people actually have: one variant only (the hub's main/ and
socratic/ folders, OpenAI's train.jsonl and train_socratic.jsonl), and ground truths the gsm8k
scorer can match."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data.prepare import prepare
from megarl.errors import DataError

pytestmark = pytest.mark.unit

QUESTION = "Tom has 1,000 apples and buys 234 more. How many does he have?"
MAIN = {"question": QUESTION, "answer": "1000 + 234 = <<1000+234=1234>>1234\n#### 1,234"}
SOCRATIC = {"question": QUESTION,
            "answer": "How many apples in all? ** 1000 + 234 = <<1000+234=1234>>1234\n#### 1,234"}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_parquet(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def answers(path: Path) -> list[str]:
    return [row["extra_info"]["answer"] for row in pq.read_table(path).to_pylist()]


def test_the_hub_layout_gives_the_main_variant_once(tmp_path: Path):
    src = tmp_path / "gsm8k"
    for split in ("train", "test"):
        write_parquet(src / "main" / f"{split}-00000-of-00001.parquet", [MAIN])
        write_parquet(src / "socratic" / f"{split}-00000-of-00001.parquet", [SOCRATIC])
    assert prepare("gsm8k", tmp_path / "out", local=str(src)) == {"train": 1, "test": 1}
    assert answers(tmp_path / "out" / "train.parquet") == [MAIN["answer"]]
    assert answers(tmp_path / "out" / "test.parquet") == [MAIN["answer"]]


def test_the_github_layout_gives_the_main_variant_once(tmp_path: Path):
    src = tmp_path / "grade_school_math" / "data"
    for split in ("train", "test"):
        write_jsonl(src / f"{split}.jsonl", [MAIN])
        write_jsonl(src / f"{split}_socratic.jsonl", [SOCRATIC])
    assert prepare("gsm8k", tmp_path / "out", local=str(src)) == {"train": 1, "test": 1}
    assert answers(tmp_path / "out" / "train.parquet") == [MAIN["answer"]]


def test_shards_of_one_variant_are_all_read(tmp_path: Path):
    src = tmp_path / "gsm8k"
    write_parquet(src / "main" / "train-00000-of-00002.parquet", [MAIN])
    write_parquet(src / "main" / "train-00001-of-00002.parquet", [{**MAIN, "question": "Another one?"}])
    write_parquet(src / "socratic" / "train-00000-of-00001.parquet", [SOCRATIC])
    assert prepare("gsm8k", tmp_path / "out", local=str(src), splits=["train"]) == {"train": 2}


def test_two_copies_that_cannot_be_told_apart_are_refused_with_their_files(tmp_path: Path):
    src = tmp_path / "gsm8k"
    write_jsonl(src / "train.jsonl", [MAIN])
    write_parquet(src / "main" / "train-00000-of-00001.parquet", [MAIN])
    with pytest.raises(DataError) as raised:
        prepare("gsm8k", tmp_path / "out", local=str(src), splits=["train"])
    message = str(raised.value)
    assert "train.jsonl" in message and "main/train-00000-of-00001.parquet" in message
    assert not (tmp_path / "out" / "train.parquet").exists()


@pytest.mark.parametrize("answer", ["Half of 36 is 18.\n####", "Half of 36 is 18.\n#### ",
                                    "Half of 36 is 18.\n#### 18 dollars", "#### eighteen"])
def test_a_final_answer_the_scorer_cannot_match_is_refused_naming_the_row(tmp_path: Path, answer: str):
    src = tmp_path / "test.jsonl"
    write_jsonl(src, [MAIN, {"question": "What is half of 36?", "answer": answer}])
    with pytest.raises(DataError) as raised:
        prepare("gsm8k", tmp_path / "out", local=str(src), splits=["test"])
    assert str(src) in str(raised.value) and "row 1" in str(raised.value)


@pytest.mark.parametrize("final", ["18", "-3", "1,234", "2.5", "$5", "1/2"])
def test_numbers_the_scorer_reads_are_accepted(tmp_path: Path, final: str):
    src = tmp_path / "test.jsonl"
    write_jsonl(src, [{"question": "Q?", "answer": f"work\n#### {final}"}])
    assert prepare("gsm8k", tmp_path / "out", local=str(src), splits=["test"]) == {"test": 1}
