"""Damaged or wrong input reaches the command line as `error: ...` naming the file and what is
wrong (exit 1, no traceback): a truncated or corrupt data file, a missing tensor index, a
safetensors index whose weight_map is not a mapping; and a path that is not a Megatron checkpoint
says what it is instead (missing, a HF directory, a run's checkpoint root)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny_hf import make_model, save_model

from megarl.convert.cli import main as convert_main
from megarl.convert.hf_to_mcore import convert_hf_to_mcore


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(make_model("llama", seed=0), tmp_path_factory.mktemp("src") / "hf", max_shard_size="60KB")


@pytest.fixture(scope="module")
def mcore(hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mc") / "mc"
    convert_hf_to_mcore(hf, out, progress=False)
    return out


def _error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the command line; it must fail with one `error:` line and no traceback. Returns the line."""
    capsys.readouterr()
    assert convert_main([*args, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


def _export(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    err = _error(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "back")], capsys)
    assert not (tmp_path / "back").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".back.")]
    return err


def test_a_truncated_data_file(mcore: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = Path(shutil.copytree(mcore, tmp_path / "mc"))
    data = ckpt / "__0_0.distcp"
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[: size - 1000])
    err = _export(ckpt, tmp_path, capsys)
    assert err.startswith(f"error: {data}: truncated ({size - 1000} bytes), tensor ")
    need = int(err.split("needs its bytes up to ")[1].split(";")[0])
    assert size - 1000 < need <= size


def test_a_corrupt_data_file_of_the_right_length(mcore: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = Path(shutil.copytree(mcore, tmp_path / "mc"))
    data = ckpt / "__0_0.distcp"
    data.write_bytes(bytes(data.stat().st_size))  # zeros: no container to read
    err = _export(ckpt, tmp_path, capsys)
    assert err.startswith(f"error: {ckpt}: cannot read tensor ") and f"from {data} (" in err
    assert err.endswith("the checkpoint is damaged")


def test_a_missing_tensor_index(mcore: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = Path(shutil.copytree(mcore, tmp_path / "mc"))
    (ckpt / ".metadata").unlink()
    err = _export(ckpt, tmp_path, capsys)
    assert err.startswith(f"error: {ckpt / '.metadata'} is missing: the checkpoint has no index of its tensors")


def test_an_unreadable_tensor_index(mcore: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = Path(shutil.copytree(mcore, tmp_path / "mc"))
    (ckpt / ".metadata").write_bytes(b"not a pickle")
    err = _export(ckpt, tmp_path, capsys)
    assert err.startswith(f"error: {ckpt / '.metadata'}: unreadable (") and err.endswith("the checkpoint is damaged")


@pytest.mark.parametrize("weight_map,named", [
    (["model.embed_tokens.weight"], "'weight_map' is a list"),
    ({"model.embed_tokens.weight": 3}, "'weight_map' is {'model.embed_tokens.weight': 3, ...}"),
])
def test_a_safetensors_index_whose_weight_map_is_not_a_mapping(hf: Path, tmp_path: Path, weight_map: object,
                                                                 named: str, capsys: pytest.CaptureFixture[str]) -> None:
    src = Path(shutil.copytree(hf, tmp_path / "hf"))
    index = src / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    content["weight_map"] = weight_map
    index.write_text(json.dumps(content))
    err = _error(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "mc")], capsys)
    assert err.startswith(f"error: {index}: {named}; a safetensors index maps each tensor name to the file")
    assert not (tmp_path / "mc").exists()


def test_what_is_not_a_megatron_checkpoint_says_what_it_is(hf: Path, mcore: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere"
    assert _export(missing, tmp_path, capsys) == f"error: {missing}: no such directory (a Megatron distributed " \
                                                 "checkpoint is expected)"
    err = _export(hf, tmp_path, capsys)
    assert err.startswith(f"error: {hf} is a HF model directory (config.json and safetensors weights), not a "
                          "Megatron distributed checkpoint")
    # A run's checkpoint root, as the trainer lays it out: the engine checkpoints are in global_step_N/actor.
    root = tmp_path / "run" / "checkpoints"
    for step in (2, 10):
        shutil.copytree(mcore, root / f"global_step_{step}" / "actor")
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    err = _export(root, tmp_path, capsys)
    assert err == (f"error: {root} is a trainer checkpoint root (it holds global_step_* step directories): pass the "
                   f"engine checkpoint of one step, global_step_N/actor (or /critic), e.g. {root}/global_step_10/actor")
    # The path it names is what the command takes.
    assert convert_main(["mcore-to-hf", "--ckpt", str(root / "global_step_10" / "actor"), "--out",
                         str(tmp_path / "back"), "--quiet"]) == 0
