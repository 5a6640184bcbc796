"""Where `megarl convert mcore-to-hf` and `megarl checkpoint verify` find a checkpoint's HF config and
tokenizer files (`find_hf_source`), and the model spec family a checkpoint records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_hf import make_model, read_all, save_model

from megarl.config import model_files
from megarl.convert.dcp_io import CheckpointReader
from megarl.convert.hf_to_mcore import HF_FILES_DIR, convert_hf_to_mcore
from megarl.convert.mcore_to_hf import convert_mcore_to_hf, find_hf_source
from megarl.errors import ConfigError
from megarl.trainer.checkpoint_verify import verify_checkpoint


def hf_dir(path: Path, **config: object) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 128,
                                                  "num_hidden_layers": 2, **config}))
    return path


def test_the_recorded_directory_then_an_initial_model_of_the_same_model(tmp_path: Path) -> None:
    run = tmp_path / "run"
    initial = hf_dir(run / "initial_model")  # the actor's model: hidden 128
    rm = hf_dir(tmp_path / "rm", hidden_size=64)  # the critic's: a reward model of another size
    critic = run / "checkpoints" / "global_step_2" / "critic"
    critic.mkdir(parents=True)
    small = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2}
    # The directory the engine was built from, recorded in the checkpoint.
    assert find_hf_source(critic, None, {"hf_config": small, "hf_dir": str(rm)}) == rm
    # It is gone (a run moved to another machine): the actor's initial_model/ is another model, passed over.
    assert find_hf_source(critic, None, {"hf_config": small, "hf_dir": str(tmp_path / "gone")}) is None
    # A recorded directory whose config changed since is passed over the same way.
    assert find_hf_source(critic, None, {"hf_config": {**small, "num_hidden_layers": 4}, "hf_dir": str(rm)}) is None
    # The actor: its initial_model/ above, recorded or not; nothing stored to compare (older checkpoints): taken.
    actor = {"model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 2}
    assert find_hf_source(run / "checkpoints" / "global_step_2" / "actor", None, {"hf_config": actor}) == initial
    assert find_hf_source(critic, None, {}) == initial
    # --hf-config, then the checkpoint's own copy, come first.
    assert find_hf_source(critic, tmp_path / "explicit", {"hf_dir": str(rm)}) == tmp_path / "explicit"
    own = hf_dir(critic / HF_FILES_DIR, hidden_size=32)
    assert find_hf_source(critic, None, {"hf_config": small, "hf_dir": str(rm)}) == own


def test_an_export_without_any_hf_directory_says_what_it_lacks(tmp_path: Path) -> None:
    src = save_model(make_model("qwen2", seed=1), tmp_path / "hf")
    convert_hf_to_mcore(src, tmp_path / "mcore", progress=False)
    shutil.rmtree(tmp_path / "mcore" / HF_FILES_DIR)  # config from the common state only
    res = convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    assert len(res.notes) == 1 and "no tokenizer or generation files were written; pass --hf-config" in res.notes[0]
    assert not (tmp_path / "back" / "tokenizer_config.json").exists()
    want, got = read_all(src), read_all(tmp_path / "back")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    with_files = convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back2", hf_config=src, progress=False)
    assert with_files.notes == () and (tmp_path / "back2" / "tokenizer_config.json").exists()


def test_a_family_named_by_spec_is_recorded_and_used_to_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A specs folder whose Qwen2 family is named "house" and lists no model_type of the model's:
    # only a family named explicitly (model.spec, --spec) maps its config.
    specs = tmp_path / "specs"
    shutil.copytree(model_files.spec_dir(), specs)
    house = (specs / "qwen2.yaml").read_text().replace("family: qwen2", "family: house")
    house = house.replace("model_types: [qwen2]", "model_types: [house_lm]").replace(
        "architectures: [Qwen2ForCausalLM]", "architectures: [HouseForCausalLM]")
    (specs / "qwen2.yaml").unlink()
    (specs / "house.yaml").write_text(house)
    monkeypatch.setenv(model_files.SPEC_DIR_ENV, str(specs))
    src = save_model(make_model("qwen2", seed=2), tmp_path / "hf")
    with pytest.raises(ConfigError, match="unsupported architecture model_type='qwen2'"):
        convert_hf_to_mcore(src, tmp_path / "refused", progress=False)
    convert_hf_to_mcore(src, tmp_path / "mcore", tp=2, progress=False, family="house")
    assert CheckpointReader(tmp_path / "mcore").common()["megarl"]["family"] == "house"
    report = verify_checkpoint(tmp_path / "mcore")
    assert report.ok, report.message()
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)  # the recorded family, no flag
    want, got = read_all(src), read_all(tmp_path / "back")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_folder_with_no_numbered_step_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "global_step_40.bak").mkdir()  # a copy put aside: no step a root would resume
    report = verify_checkpoint(tmp_path)
    assert not report.ok and report.kind == "unknown"
    assert f"{tmp_path}: not a checkpoint: expected a trainer checkpoint" in report.message()
