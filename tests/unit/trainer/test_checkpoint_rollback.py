"""Checkpoints after a resume from an older checkpoint by path: the abandoned continuation left
higher-step dirs. The save just committed is kept, the latest file names it, pruning goes by commit
order (the abandoned dirs first), and auto-resume and the disk-full message follow the latest file."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

import megarl.trainer.checkpoint_dirs as checkpoint_dirs
import megarl.trainer.checkpointing as checkpointing
from megarl.errors import CheckpointError
from megarl.trainer.checkpoint_dirs import COMPLETE_MARKER, LATEST_FILE, CheckpointDirs
from megarl.trainer.checkpointing import TrainerCheckpointer

pytestmark = pytest.mark.unit


def _save(dirs: CheckpointDirs, step: int, payload: str = "weights") -> Path:
    tmp = dirs.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "model.bin").write_text(f"{payload} {step}")
    return dirs.commit(tmp, step)


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[-1]) for p in root.glob("global_step_*"))


def test_a_rolled_back_save_is_kept_and_resumed(tmp_path: Path) -> None:
    """Dirs 10, 20, 30 from the first run; it resumed step 10 by path and saves step 20, keep 1."""
    for step in (10, 20, 30):
        _save(CheckpointDirs(tmp_path, max_to_keep=0), step)
    dirs = CheckpointDirs(tmp_path, max_to_keep=1)
    final = _save(dirs, 20, payload="rolled back")
    assert final == tmp_path / "global_step_20" and final.is_dir()
    assert (final / "actor" / "model.bin").read_text() == "rolled back 20"
    assert (tmp_path / LATEST_FILE).read_text() == "20"
    assert _steps(tmp_path) == [20]
    assert dirs.latest() == (20, final)
    assert CheckpointDirs(tmp_path, max_to_keep=1).resolve_resume("auto") == (20, final)


def test_abandoned_dirs_are_pruned_first_then_oldest_commit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = CheckpointDirs(tmp_path, max_to_keep=0)
    for step in (10, 20, 30, 40):
        _save(first, step)
    dirs = CheckpointDirs(tmp_path, max_to_keep=3)  # resumed step 10 by path
    _save(dirs, 20, payload="again")
    assert _steps(tmp_path) == [10, 20, 40]  # 30 (abandoned, older commit than 40) went, 10 stays
    assert (tmp_path / LATEST_FILE).read_text() == "20"
    with caplog.at_level("WARNING"):
        assert dirs.resolve_resume("auto") == (20, tmp_path / "global_step_20")
    assert "global_step_40" in caplog.text and "not resumed from" in caplog.text
    _save(dirs, 25)
    assert _steps(tmp_path) == [10, 20, 25]  # the last abandoned dir goes before the run's own
    _save(dirs, 35)
    assert _steps(tmp_path) == [20, 25, 35]  # then the oldest commit
    seqs = [json.loads((tmp_path / f"global_step_{s}" / COMPLETE_MARKER).read_text())["seq"] for s in (20, 25, 35)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3


def test_without_latest_file_the_last_commit_is_resumed(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        _save(CheckpointDirs(tmp_path), step)
    dirs = CheckpointDirs(tmp_path)
    _save(dirs, 20, payload="again")
    (tmp_path / LATEST_FILE).unlink()
    assert dirs.latest() == (20, tmp_path / "global_step_20")
    assert dirs.resolve_resume("auto") == (20, tmp_path / "global_step_20")
    (tmp_path / LATEST_FILE).write_text("twenty")  # damaged by hand: a save still works, resume says which file
    assert dirs.latest() == (20, tmp_path / "global_step_20")
    with pytest.raises(CheckpointError, match=f"{LATEST_FILE}: 'twenty' is not a step number"):
        dirs.resolve_resume("auto")
    _save(dirs, 21)
    assert dirs.resolve_resume("auto") == (21, tmp_path / "global_step_21")


def test_auto_resume_refuses_a_latest_file_naming_a_missing_dir(tmp_path: Path) -> None:
    dirs = CheckpointDirs(tmp_path)
    for step in (10, 20):
        _save(dirs, step)
    shutil.rmtree(tmp_path / "global_step_20")
    with pytest.raises(CheckpointError, match="names step 20.*not a complete checkpoint.*global_step_10"):
        dirs.resolve_resume("auto")


def test_latest_file_is_written_before_the_replaced_copy_is_removed(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (10, 20, 30):
        _save(CheckpointDirs(tmp_path), step)
    dirs = CheckpointDirs(tmp_path, max_to_keep=2)
    real_remove = checkpoint_dirs._remove

    def killed_while_removing_the_old_copy(path: Path) -> None:
        if "replaced" in path.name:
            raise KeyboardInterrupt  # stands for a kill during the slow delete
        real_remove(path)

    monkeypatch.setattr(checkpoint_dirs, "_remove", killed_while_removing_the_old_copy)
    with pytest.raises(KeyboardInterrupt):
        _save(dirs, 20, payload="again")
    monkeypatch.undo()
    assert (tmp_path / LATEST_FILE).read_text() == "20"
    restarted = CheckpointDirs(tmp_path, max_to_keep=2)
    assert not list(tmp_path.glob(".tmp-*"))
    assert restarted.resolve_resume("auto") == (20, tmp_path / "global_step_20")
    assert (tmp_path / "global_step_20" / "actor" / "model.bin").read_text() == "again 20"


def test_disk_full_message_names_the_checkpoint_a_resume_continues_from(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("trainer: {}\n")
    dirs = CheckpointDirs(tmp_path / "ckpts")
    checkpointer = TrainerCheckpointer(dirs, {}, config)
    for step in (10, 20, 30, 20):  # the last: after a resume of step 10 by path
        checkpointer.save(step, {"global_step": step})
    checked: list[Path] = []

    def verified(path: Path) -> SimpleNamespace:
        checked.append(Path(path))
        return SimpleNamespace(ok=True)

    def full_disk(src, dst, *args, **kwargs):  # a stand-in for a full disk: the copy of the config
        Path(dst).write_bytes(b"tra")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    monkeypatch.setattr(checkpointing, "verify_checkpoint", verified)
    monkeypatch.setattr(shutil, "copy", full_disk)
    with pytest.raises(CheckpointError) as caught:
        checkpointer.save(25, {"global_step": 25})
    first = str(caught.value).splitlines()[0]
    assert first.endswith(f"the previous checkpoint {dirs.root / 'global_step_20'} is intact (step 20, verified)")
    assert checked == [dirs.root / "global_step_20"]
