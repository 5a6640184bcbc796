"""`megarl convert` refuses what would destroy its input or divide by zero: an --out that is, holds or
lies inside the source (even with --overwrite), and parallel sizes below 1; the source is left intact."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_hf import make_model, save_model

from megarl.cli import main as megarl_main
from megarl.convert.hf_to_mcore import convert_hf_to_mcore

pytestmark = pytest.mark.unit


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def mcore(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("guard")
    hf = save_model(make_model("qwen2", seed=0), base / "hf")
    convert_hf_to_mcore(hf, base / "run" / "ckpt", progress=False)
    return base / "run" / "ckpt"


@pytest.mark.parametrize("where", ["same", "parent", "inside"])
def test_out_overlapping_the_source_is_refused_and_the_source_kept(mcore: Path, where: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = {"same": mcore, "parent": mcore.parent, "inside": mcore / "exported"}[where]
    before = _files(mcore.parent)
    rc = megarl_main(["convert", "mcore-to-hf", "--ckpt", str(mcore), "--out", str(out), "--overwrite", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1
    relation = {"same": "is", "parent": "holds", "inside": "lies inside"}[where]
    assert f"--out {out} {relation} the source --ckpt {mcore}" in err
    assert _files(mcore.parent) == before  # nothing written, nothing removed


@pytest.mark.parametrize("flag,value", [("--tp", "0"), ("--pp", "-1"), ("--ep", "two")])
def test_parallel_sizes_below_one_are_refused(tmp_path: Path, flag: str, value: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        megarl_main(["convert", "hf-to-mcore", "--hf", str(tmp_path), "--out", str(tmp_path / "out"), flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and ("valid: an integer >= 1" in err or "not an integer" in err)
    assert not (tmp_path / "out").exists()
