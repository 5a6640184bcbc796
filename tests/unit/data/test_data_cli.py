"""`megarl data make` and `megarl data inspect` through argparse."""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megarl.data.cli import register_cli
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import DataError

pytestmark = pytest.mark.unit


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megarl")
    register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_make_arithmetic_with_tokenizer(tmp_path: Path) -> None:
    out, tok = tmp_path / "arith", tmp_path / "tok"
    argv = [
        "data",
        "make",
        "arithmetic",
        "--out",
        str(out),
        "--train-size",
        "64",
        "--val-size",
        "16",
        "--num-operands",
        "3",
        "--max-value",
        "20",
        "--operators",
        "+-",
        "--tokenizer-out",
        str(tok),
    ]
    assert run(argv) == 0
    train, val = (
        pq.read_table(out / "train.parquet").to_pylist(),
        pq.read_table(out / "val.parquet").to_pylist(),
    )
    assert len(train) == 64 and len(val) == 16
    tokenizer = load_tokenizer(tok)
    for r in train + val:
        text = r["prompt"][0]["content"] + r["reward_model"]["ground_truth"]
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text
    assert "a" not in tokenizer.get_vocab()  # letters only when asked


def test_make_preset_and_extra_chars(tmp_path: Path) -> None:
    argv = [
        "data",
        "make",
        "arithmetic",
        "--out",
        str(tmp_path),
        "--preset",
        "single_digit_addition",
        "--train-size",
        "10",
        "--val-size",
        "2",
        "--tokenizer-out",
        str(tmp_path / "tok"),
        "--extra-chars",
        "ab",
    ]
    assert run(argv) == 0
    assert all(
        len(r["prompt"][0]["content"]) == 4 for r in pq.read_table(tmp_path / "train.parquet").to_pylist()
    )
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert tokenizer.unk_token_id not in tokenizer("ab")["input_ids"]


def test_make_countdown_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run(
            [
                "data",
                "make",
                "countdown",
                "--out",
                str(tmp_path),
                "--train-size",
                "5",
                "--val-size",
                "3",
                "--num-numbers",
                "4",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert run(["data", "inspect", str(tmp_path / "val.parquet"), "--rows", "2"]) == 0
    printed = capsys.readouterr().out
    assert "rows: 3" in printed
    assert (
        "reward_model: struct<style: string, "
        "ground_truth: struct<target: int64, numbers: list<element: int64>>>" in printed
    )
    assert printed.count("row ") == 2 and '"countdown"' in printed


def test_inspect_unreadable_file(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").write_text("nope")
    with pytest.raises(DataError, match="not a readable parquet file"):
        run(["data", "inspect", str(tmp_path / "x.parquet")])


@pytest.mark.parametrize("size", ["0", "-3", "ten"])
def test_a_split_size_under_one_is_a_usage_error_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], size: str) -> None:
    with pytest.raises(SystemExit) as done:
        run(["data", "make", "arithmetic", "--out", str(tmp_path / "arith"), f"--val-size={size}"])
    assert done.value.code == 2
    assert f"{size!r} is not a number of rows; valid: an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "arith").exists()


def test_options_that_would_be_ignored_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--preset sets every task option: one given beside it is refused, not dropped; arithmetic_tools
    builds its own ChatML tokenizer, so it takes no --extra-chars (argparse's usage error, exit 2)."""
    from megarl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--preset single_digit_addition sets the task's options; remove "
                                          r"--max-value, --spaces or the preset"):
        run(["data", "make", "arithmetic", "--out", str(tmp_path / "a"), "--preset", "single_digit_addition",
             "--max-value", "20", "--spaces"])
    assert not (tmp_path / "a").exists()
    with pytest.raises(SystemExit) as done:
        run(["data", "make", "arithmetic_tools", "--out", str(tmp_path / "t"), "--extra-chars", "xyz"])
    assert done.value.code == 2 and "unrecognized arguments: --extra-chars" in capsys.readouterr().err
    # The defaults still apply when no option is given.
    assert run(["data", "make", "arithmetic", "--out", str(tmp_path / "d"), "--train-size", "4", "--val-size", "2"]) == 0
    prompt = pq.read_table(tmp_path / "d" / "train.parquet").to_pylist()[0]["prompt"][0]["content"]
    assert prompt.endswith("=") and "+" in prompt
