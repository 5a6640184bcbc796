"""The `megarl convert` command line and tools/convert_checkpoint.py: success and error exits."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch
from tiny_hf import make_model, read_all, save_model

from megarl.cli import main as megarl_main
from megarl.convert.dcp_io import CheckpointReader
from megarl.convert.cli import main as convert_main


def test_megarl_convert_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = save_model(make_model("qwen2", seed=7), tmp_path / "hf")
    assert megarl_main(["convert", "hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "mc"),
                        "--tp", "2", "--pp", "2", "--spec", "qwen2"]) == 0
    assert CheckpointReader(tmp_path / "mc").common()["megarl"]["family"] == "qwen2"
    err = capsys.readouterr().err
    assert "hf-to-mcore:" in err and "chunks" in err  # progress lines (stderr is not a TTY here)
    assert convert_main(["mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "back"),
                         "--quiet", "--max-shard-size", "40KB"]) == 0
    out = capsys.readouterr()
    assert "wrote" in out.out and out.err == ""
    want, got = read_all(src), read_all(tmp_path / "back")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_errors_exit_1_with_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = save_model(make_model("llama", seed=0), tmp_path / "hf")
    assert convert_main(["hf-to-mcore", "--hf", str(src), "--out", str(src), "--quiet"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert convert_main(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "o"), "--spec", "qwen9"]) == 1
    assert "model spec 'qwen9': no such family" in capsys.readouterr().err
    assert megarl_main(["convert", "hf-to-mcore", "--hf", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 1
    assert "no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: a required option missing
        convert_main(["mcore-to-hf", "--out", str(tmp_path / "o")])


@pytest.mark.parametrize("size", ["2G", "abc", "0", "-5MB"])
def test_a_bad_shard_size_is_a_usage_error_naming_the_valid_forms(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  size: str) -> None:
    with pytest.raises(SystemExit) as done:  # argparse: exit 2 before anything is read or written
        convert_main(["mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "o"),
                      f"--max-shard-size={size}"])
    assert done.value.code == 2
    assert f"{size!r} is not a size; valid: a number of bytes >= 1, or one with a unit" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_tools_script_runs_the_same_main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = save_model(make_model("llama_tied", seed=0), tmp_path / "hf")
    script = Path(__file__).resolve().parents[3] / "tools" / "convert_checkpoint.py"
    monkeypatch.setattr(sys, "argv", [str(script), "hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "mc"), "--quiet"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code == 0 and (tmp_path / "mc" / "metadata.json").exists()
