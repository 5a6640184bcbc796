"""A HF config of another model than the one converted or saved: `megarl convert` and `megarl
checkpoint verify` exit 1 with an `error:` line (or a reported problem) naming the config file, the
field or tensors that differ and the family that fits, instead of a KeyError traceback or an
export that silently drops trained tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_hf import make_model, save_model

from megarl.cli import main as megarl_main
from megarl.convert.hf_to_mcore import HF_FILES_DIR, convert_hf_to_mcore

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("families")
    dirs = {kind: save_model(make_model(kind, seed=0), base / kind) for kind in ("llama", "llama_tied", "qwen2")}
    for kind in ("llama", "qwen2"):
        dirs[f"{kind}_ckpt"] = base / f"{kind}_ckpt"
        convert_hf_to_mcore(dirs[kind], dirs[f"{kind}_ckpt"], progress=False)
    return dirs


def _without_stored_config(ckpt: Path, tmp_path: Path) -> Path:
    """A copy of a converted checkpoint whose common state stores no HF config and that keeps no
    copy of the HF files, as a checkpoint of an older megarl: only --hf-config describes its model."""
    import shutil

    copy = tmp_path / f"{ckpt.name}_no_config"
    shutil.copytree(ckpt, copy)
    shutil.rmtree(copy / HF_FILES_DIR)
    common = torch.load(copy / "common.pt", weights_only=False)
    del common["megarl"]["hf_config"]
    torch.save(common, copy / "common.pt")
    return copy


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = megarl_main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


@pytest.mark.parametrize("spec,tensor", [("qwen2", "model.layers.0.self_attn.q_proj.bias"),
                                         ("qwen3", "model.layers.0.self_attn.q_norm.weight")])
def test_hf_to_mcore_with_the_spec_of_another_family(models: dict[str, Path], tmp_path: Path, spec: str, tensor: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _run(["convert", "hf-to-mcore", "--hf", str(models["llama"]), "--out", str(tmp_path / "out"),
                    "--spec", spec, "--quiet"], capsys)
    assert rc == 1 and err.startswith("error: ")
    assert f"model spec {spec}.yaml (family '{spec}') does not fit {models['llama'] / 'config.json'}" in err
    assert f"no HF tensors ['{tensor}'" in err
    assert "its model_type 'llama' is listed by family 'llama' (llama.yaml)" in err
    assert not (tmp_path / "out").exists()


def test_mcore_to_hf_with_the_config_of_another_family(models: dict[str, Path], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _run(["convert", "mcore-to-hf", "--ckpt", str(models["qwen2_ckpt"]), "--out", str(tmp_path / "out"),
                    "--hf-config", str(models["llama"]), "--quiet"], capsys)
    assert rc == 1 and err.startswith("error: ")
    assert (f"--hf-config {models['llama'] / 'config.json'} describes another model than the one saved in "
            f"{models['qwen2_ckpt']}") in err
    assert "model_type='llama', stored 'qwen2'" in err
    assert not (tmp_path / "out").exists()


def test_verify_with_the_config_of_another_family(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _run(["checkpoint", "verify", str(models["qwen2_ckpt"]), "--hf-config", str(models["llama"])], capsys)
    assert rc == 1
    assert "NOT usable" in err and "model_type='llama', stored 'qwen2'" in err


@pytest.mark.parametrize("command", ["mcore-to-hf", "verify"])
def test_a_checkpoint_without_a_stored_config_and_the_config_of_another_family(
        models: dict[str, Path], tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _without_stored_config(models["qwen2_ckpt"], tmp_path)
    if command == "mcore-to-hf":
        argv = ["convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "out"),
                "--hf-config", str(models["llama"]), "--quiet"]
    else:
        argv = ["checkpoint", "verify", str(ckpt), "--hf-config", str(models["llama"])]
    rc, err = _run(argv, capsys)
    assert rc == 1
    if command == "mcore-to-hf":
        assert err.startswith("error: ")
    assert f"model spec qwen2.yaml (family 'qwen2') does not fit {models['llama'] / 'config.json'}" in err
    assert "no HF tensors ['model.layers.0.self_attn.q_proj.bias'" in err
    assert "its model_type 'llama' is listed by family 'llama' (llama.yaml)" in err
    assert not (tmp_path / "out").exists()


def test_a_tied_config_over_an_untied_checkpoint_is_refused(models: dict[str, Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _run(["convert", "mcore-to-hf", "--ckpt", str(models["llama_ckpt"]), "--out", str(tmp_path / "out"),
                    "--hf-config", str(models["llama_tied"]), "--quiet"], capsys)
    assert rc == 1 and err.startswith("error: ")
    assert f"--hf-config {models['llama_tied'] / 'config.json'} describes another model" in err
    assert "tie_word_embeddings=True, stored False" in err
    assert not (tmp_path / "out").exists()
    # The same config naming the model it was converted from is accepted.
    rc, err = _run(["convert", "mcore-to-hf", "--ckpt", str(models["llama_ckpt"]), "--out", str(tmp_path / "out"),
                    "--hf-config", str(models["llama"]), "--quiet"], capsys)
    assert rc == 0, err


def test_a_tied_config_over_a_checkpoint_without_a_stored_config_would_drop_its_lm_head(
        models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _without_stored_config(models["llama_ckpt"], tmp_path)
    rc, err = _run(["convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "out"),
                    "--hf-config", str(models["llama_tied"]), "--quiet"], capsys)
    assert rc == 1 and err.startswith("error: ")
    assert f"{ckpt}: checkpoint tensors ['output_layer.weight'] have no place in the HF model of " in err
    assert str(models["llama_tied"] / "config.json") in err
    assert not (tmp_path / "out").exists()
