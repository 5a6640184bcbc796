"""Checkpoint directories: atomic commit, pruning, latest, crash leftovers, resume resolution, RNG state."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megarl.errors import CheckpointError, ConfigError
from megarl.trainer.checkpoint_dirs import (
    COMPLETE_MARKER,
    LATEST_FILE,
    CheckpointDirs,
    capture_rng_state,
    read_marker,
    restore_rng_state,
)

pytestmark = pytest.mark.unit


def _save(dirs: CheckpointDirs, step: int, payload: str = "weights") -> Path:
    tmp = dirs.begin(step)
    assert tmp.parent == dirs.root and tmp.name.startswith(".tmp-")
    (tmp / "actor").mkdir()
    (tmp / "actor" / "model.bin").write_text(f"{payload} {step}")
    return dirs.commit(tmp, step)


def test_commit_prune_and_latest(tmp_path: Path) -> None:
    dirs = CheckpointDirs(tmp_path, max_to_keep=2)
    assert dirs.latest() is None
    for step in (10, 20, 30):
        final = _save(dirs, step)
        assert final == tmp_path / f"global_step_{step}"
        assert (tmp_path / LATEST_FILE).read_text() == str(step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_20", "global_step_30", LATEST_FILE]
    assert dirs.latest() == (30, tmp_path / "global_step_30")
    assert (tmp_path / "global_step_30" / "actor" / "model.bin").read_text() == "weights 30"
    marker = json.loads((tmp_path / "global_step_30" / COMPLETE_MARKER).read_text())
    assert marker["step"] == 30 and marker["time"].endswith("Z") and marker["unix_time"] > 0


def test_keep_all_and_saving_a_step_again(tmp_path: Path) -> None:
    dirs = CheckpointDirs(tmp_path, max_to_keep=0)
    for step in (1, 2, 3):
        _save(dirs, step)
    assert [s for s, _ in dirs.complete_checkpoints()] == [1, 2, 3]
    _save(dirs, 2, payload="again")  # e.g. after resuming from an older checkpoint by path
    assert (tmp_path / "global_step_2" / "actor" / "model.bin").read_text() == "again 2"
    assert not list(tmp_path.glob(".tmp-*"))


def test_crash_leftovers_are_ignored_and_cleaned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dirs = CheckpointDirs(tmp_path, max_to_keep=3)
    _save(dirs, 5)
    # Killed mid-write: a tmp dir with half the files and no marker.
    half = dirs.begin(6)
    (half / "actor.bin").write_text("half")
    # Killed between writing the marker and the rename: still a tmp dir, so not a checkpoint yet.
    marked = tmp_path / ".tmp-step_9-99999"
    marked.mkdir()
    (marked / COMPLETE_MARKER).write_text('{"step": 9}')
    # A global_step dir lacking the marker (copied by hand, or written by another tool).
    (tmp_path / "global_step_7").mkdir()
    (tmp_path / "global_step_7" / "model.bin").write_text("?")
    # A marker that names a different step than the dir.
    (tmp_path / "global_step_8").mkdir()
    (tmp_path / "global_step_8" / COMPLETE_MARKER).write_text('{"step": 3}')
    with caplog.at_level("WARNING"):
        assert dirs.latest() == (5, tmp_path / "global_step_5")
    assert "global_step_7" in caplog.text and "global_step_8" in caplog.text
    assert dirs.incomplete_checkpoints() == [tmp_path / "global_step_7", tmp_path / "global_step_8"]

    restarted = CheckpointDirs(tmp_path, max_to_keep=3)  # a new process after the crash
    assert not half.exists() and not marked.exists()
    assert restarted.latest() == (5, tmp_path / "global_step_5")
    assert (tmp_path / "global_step_7").exists()  # not ours to delete, only ignored


def test_kill_during_a_save_in_a_real_process(tmp_path: Path) -> None:
    """A child process is killed by SIGKILL after writing half a checkpoint: step 1 stays the latest."""
    script = (
        "import os, signal, sys\n"
        "from megarl.trainer.checkpoint_dirs import CheckpointDirs\n"
        "d = CheckpointDirs(sys.argv[1], max_to_keep=2)\n"
        "t = d.begin(1); open(os.path.join(t, 'w'), 'w').write('one'); d.commit(t, 1)\n"
        "t = d.begin(2); open(os.path.join(t, 'w'), 'w').write('half')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, timeout=120)
    assert result.returncode == -9, result.stderr.decode()
    assert len(list(tmp_path.glob(".tmp-step_2-*"))) == 1
    dirs = CheckpointDirs(tmp_path, max_to_keep=2)
    assert dirs.resolve_resume("auto") == (1, tmp_path / "global_step_1")
    assert not list(tmp_path.glob(".tmp-*"))


def test_resolve_resume_modes_and_errors(tmp_path: Path) -> None:
    dirs = CheckpointDirs(tmp_path / "ckpt", max_to_keep=2)
    assert dirs.resolve_resume("auto") is None
    _save(dirs, 4)
    assert dirs.resolve_resume("auto") == (4, tmp_path / "ckpt" / "global_step_4")
    assert dirs.resolve_resume("disable") is None
    assert dirs.resolve_resume("resume_path", tmp_path / "ckpt" / "global_step_4") == (
        4,
        tmp_path / "ckpt" / "global_step_4",
    )
    with pytest.raises(ConfigError, match="resume_mode='latest'.*auto"):
        dirs.resolve_resume("latest")
    with pytest.raises(ConfigError, match="resume_from_path"):
        dirs.resolve_resume("resume_path", None)
    with pytest.raises(CheckpointError, match="global_step_9.*does not exist.*global_step_4"):
        dirs.resolve_resume("resume_path", tmp_path / "ckpt" / "global_step_9")
    incomplete = tmp_path / "ckpt" / "global_step_6"
    incomplete.mkdir()
    with pytest.raises(CheckpointError, match=f"global_step_6.*no {COMPLETE_MARKER} marker"):
        dirs.resolve_resume("resume_path", incomplete)
    with pytest.raises(CheckpointError, match="checkpoint root"):
        dirs.resolve_resume("resume_path", tmp_path / "ckpt")
    (incomplete / COMPLETE_MARKER).write_text("not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        read_marker(incomplete)


def test_commit_refuses_a_foreign_dir(tmp_path: Path) -> None:
    dirs = CheckpointDirs(tmp_path)
    tmp = dirs.begin(3)
    with pytest.raises(CheckpointError, match="not the dir begin"):
        dirs.commit(tmp, 4)
    other = tmp_path / "elsewhere"
    other.mkdir()
    with pytest.raises(CheckpointError, match="not the dir begin"):
        dirs.commit(other, 3)


def test_rng_state_round_trip_through_torch_save(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's legacy state
    state = capture_rng_state()
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    torch.save(state, tmp_path / "rng.pt")
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expected
    with pytest.raises(CheckpointError, match="numpy"):
        restore_rng_state({"python": state["python"]})


def test_before_rename_runs_on_a_written_checkpoint_before_it_is_found(tmp_path: Path) -> None:
    """`commit(before_rename=...)` (where the trainer logs the step's metrics) runs once the files
    and the marker are written, before the rename that makes the checkpoint the one a resume finds;
    one that raises leaves no checkpoint and the latest file as it was."""
    dirs = CheckpointDirs(tmp_path, max_to_keep=0)
    _save(dirs, 1)
    seen = []

    def hook() -> None:
        (tmp,) = tmp_path.glob(".tmp-step_2-*")
        seen.append(((tmp / COMPLETE_MARKER).is_file(), dirs.latest(), (tmp_path / LATEST_FILE).read_text()))

    tmp = dirs.begin(2)
    (tmp / "model.bin").write_text("2")
    assert dirs.commit(tmp, 2, before_rename=hook) == tmp_path / "global_step_2"
    assert seen == [(True, (1, tmp_path / "global_step_1"), "1")]
    assert dirs.latest() == (2, tmp_path / "global_step_2")

    def failing() -> None:
        raise OSError("the metrics store went away")

    tmp = dirs.begin(3)
    (tmp / "model.bin").write_text("3")
    with pytest.raises(OSError, match="went away"):
        dirs.commit(tmp, 3, before_rename=failing)
    assert not (tmp_path / "global_step_3").exists() and (tmp_path / LATEST_FILE).read_text() == "2"
