"""GSM8K and MATH conversion from local copies into the verl column layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import PreTrainedTokenizerBase

from megarl.data.dataset import RLDataset
from megarl.data.prepare import GSM8K_INSTRUCTION, MATH_INSTRUCTION, prepare
from megarl.errors import DataError
from megarl.rewards.scorers import score_builtin

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[3]

GSM8K_TRAIN = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,000 eggs twice. How many?", "answer": "2 * 1000 = 2000\n#### 2,000"},
]
GSM8K_TEST = [{"question": "What is 5 - 8?", "answer": "5 - 8 = -3\n#### -3"}]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def gsm8k_copy(root: Path) -> Path:
    """The hub layout: main/train-*.parquet style names (one split as jsonl, one as parquet)."""
    write_jsonl(root / "main" / "train-00000-of-00001.jsonl", GSM8K_TRAIN)
    (root / "main").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(GSM8K_TEST), root / "main" / "test-00000-of-00001.parquet")
    return root


def test_gsm8k_from_a_local_copy(tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase) -> None:
    counts = prepare("gsm8k", tmp_path / "out", local=str(gsm8k_copy(tmp_path / "gsm8k")))
    assert counts == {"train": 2, "test": 1}
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert rows[1]["data_source"] == "openai/gsm8k"
    assert rows[1]["prompt"] == [
        {"role": "user", "content": f"{GSM8K_TRAIN[1]['question']} {GSM8K_INSTRUCTION}"}
    ]
    assert rows[1]["reward_model"] == {"style": "rule", "ground_truth": "2000"}
    assert rows[1]["extra_info"]["answer"] == GSM8K_TRAIN[1]["answer"] and rows[1]["extra_info"]["index"] == 1
    test_rows = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert (
        test_rows[0]["reward_model"]["ground_truth"] == "-3" and test_rows[0]["extra_info"]["split"] == "test"
    )
    # The reference solution scores 1 with the gsm8k scorer; the files load as an RL dataset.
    for r, source in zip(rows, GSM8K_TRAIN):
        assert (
            score_builtin(r["data_source"], source["answer"], r["reward_model"]["ground_truth"])["score"]
            == 1.0
        )
    dataset = RLDataset(
        str(tmp_path / "out" / "train.parquet"),
        char_tokenizer,
        max_prompt_length=512,
        cache_dir=str(tmp_path / "cache"),
    )
    assert len(dataset) == 2 and dataset[1]["ground_truth"] == "2000"


def test_math_from_the_original_json_tree(tmp_path: Path) -> None:
    root = tmp_path / "MATH"
    problems = {
        "train/algebra/1.json": {
            "problem": "Compute $\\frac{2}{4}$.",
            "level": "Level 1",
            "type": "Algebra",
            "solution": "It is $\\boxed{\\frac{1}{2}}$.",
        },
        "train/geometry/7.json": {
            "problem": "Angle?",
            "level": "Level 3",
            "type": "Geometry",
            "solution": "First $\\boxed{3}$, finally $\\boxed{90^\\circ}$.",
        },
        "test/algebra/2.json": {
            "problem": "x?",
            "level": "Level 2",
            "type": "Algebra",
            "solution": "$x = \\boxed{-1}$",
        },
    }
    for name, problem in problems.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(problem))
    assert prepare("math", tmp_path / "out", local=str(root)) == {"train": 2, "test": 1}
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{1}{2}", "90^\\circ"]
    assert rows[0]["prompt"][0]["content"] == f"Compute $\\frac{{2}}{{4}}$. {MATH_INSTRUCTION}"
    assert rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert rows[1]["extra_info"] == {"split": "train", "index": 1, "level": "Level 3", "type": "Geometry"}


def test_single_file_is_one_split(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "some.jsonl", GSM8K_TEST)
    with pytest.raises(DataError, match="a single file holds one split"):
        prepare("gsm8k", tmp_path / "out", local=str(tmp_path / "some.jsonl"))
    assert prepare("gsm8k", tmp_path / "out", local=str(tmp_path / "some.jsonl"), splits=["test"]) == {
        "test": 1
    }


def test_bad_rows_name_file_row_and_column(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", [GSM8K_TRAIN[0], {"question": "q"}])
    with pytest.raises(DataError, match=r"train.jsonl: row 1, column 'answer': missing"):
        prepare("gsm8k", tmp_path / "out", local=str(tmp_path / "train.jsonl"), splits=["train"])
    write_jsonl(tmp_path / "train.jsonl", [GSM8K_TRAIN[0], {"question": "q", "answer": "no final"}])
    with pytest.raises(DataError, match=r"train.jsonl: row 1, column 'answer': no '####'"):
        prepare("gsm8k", tmp_path / "out", local=str(tmp_path / "train.jsonl"), splits=["train"])
    (tmp_path / "train.jsonl").write_text(json.dumps(GSM8K_TRAIN[0]) + "\n{broken\n")
    with pytest.raises(DataError, match=r"train.jsonl: row 1 is not valid JSON"):
        prepare("gsm8k", tmp_path / "out", local=str(tmp_path / "train.jsonl"), splits=["train"])
    write_jsonl(tmp_path / "m" / "train.jsonl", [{"problem": "p", "solution": "no box"}])
    with pytest.raises(DataError, match=r"train.jsonl: row 0, column 'solution': no \\boxed"):
        prepare("math", tmp_path / "out", local=str(tmp_path / "m"), splits=["train"])
    assert not (tmp_path / "out" / "train.parquet").exists()  # nothing half-written
    (tmp_path / "train.jsonl").write_text(json.dumps(GSM8K_TRAIN[0]) + "\n[1, 2]\n")
    with pytest.raises(DataError, match=r"train.jsonl: row 1 is a list, not an object with a 'question' field"):
        prepare("gsm8k", tmp_path / "out", local=str(tmp_path / "train.jsonl"), splits=["train"])
    (tmp_path / "bad.parquet").write_bytes(b"PAR1" + b"\0" * 64 + b"PAR1")
    with pytest.raises(DataError, match=r"bad.parquet: not a readable parquet file"):
        prepare("gsm8k", tmp_path / "out", local=str(tmp_path / "bad.parquet"), splits=["train"])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"no rows to write to .*train.parquet: the source gave none"):
        prepare("gsm8k", tmp_path / "out", local=str(tmp_path / "empty.jsonl"), splits=["train"])


def test_missing_split_and_missing_source(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d" / "train.jsonl", GSM8K_TRAIN)
    with pytest.raises(DataError, match="no .* file for split 'test'"):
        prepare("gsm8k", tmp_path / "out", local=str(tmp_path / "d"))
    with pytest.raises(DataError, match="does not exist"):
        prepare("gsm8k", tmp_path / "out", local=str(tmp_path / "absent"))


def test_hub_unreachable_suggests_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(DataError, match="--local"):
        prepare("gsm8k", tmp_path / "out", hub_name="megarl-test/does-not-exist", splits=["train"])


def test_tool_script_runs(tmp_path: Path) -> None:
    source = gsm8k_copy(tmp_path / "gsm8k")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "tools" / "prepare_gsm8k.py"),
            "--out",
            str(tmp_path / "out"),
            "--local",
            str(source),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "train: 2 rows" in result.stdout and "test: 1 rows" in result.stdout
    assert pq.read_metadata(tmp_path / "out" / "test.parquet").num_rows == 1
    # Bad input: one line naming the problem, exit 1, no traceback.
    failed = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "prepare_gsm8k.py"), "--out",
                             str(tmp_path / "out2"), "--local", str(tmp_path / "absent")],
                            capture_output=True, text=True, env=env, timeout=120)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert f"error: {tmp_path / 'absent'}: does not exist" in failed.stderr
