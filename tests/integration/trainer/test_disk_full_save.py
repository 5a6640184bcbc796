"""No space left during a save: the partial checkpoint is removed, the previous one verifies, the
error says so on its first line, and the run's report holds no empty PNG.

The full disk is a stand-in (full_disk_driver.py: the driver's write into the step's temporary
checkpoint directory raises OSError(ENOSPC) after writing a few bytes); a real full file system
raises the same error from the same write."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.figure
import matplotlib.image
import pytest
from ray.exceptions import RayTaskError

from megarl.errors import CheckpointError, WorkerError
from megarl.trainer.checkpoint_dirs import CheckpointDirs
from megarl.trainer.checkpoint_verify import verify_checkpoint
from megarl.trainer.checkpointing import TrainerCheckpointer, is_disk_full
from megarl.tracking.plots import MetricTable, write_plots
from test_train_e2e import read_metrics, task_dir, write_config  # noqa: F401 (fixture)

DRIVER = Path(__file__).with_name("full_disk_driver.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_with_full_disk(config: Path, step: int, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(DRIVER), str(step), str(config), *overrides],
                          capture_output=True, text=True, timeout=600, env=env, cwd=config.parent)


def assert_valid_pngs(report_dir: Path) -> list[Path]:
    pngs = sorted(report_dir.glob("*.png"))
    for png in pngs:
        assert png.read_bytes()[:8] == PNG_MAGIC, png
        image = matplotlib.image.imread(png)
        assert image.shape[0] > 100 and image.shape[1] > 100, (png, image.shape)
        assert image.std() > 0, f"{png} is blank"
    assert not [p for p in report_dir.iterdir() if p.name.startswith(".")], "a temporary plot file was left"
    return pngs


@pytest.mark.integration
def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    config = write_config(tmp_path, task_dir)
    proc = run_with_full_disk(config, 2, "trainer.total_training_steps=3", "trainer.save_freq=1",
                              "tracking.report_plots=true")
    assert proc.returncode == 1, proc.stderr[-3000:]
    ckpts = tmp_path / "run" / "checkpoints"
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert error == [f"error: No space left on device while saving checkpoint {ckpts / 'global_step_2'}; "
                     f"the partial save was removed; the previous checkpoint {ckpts / 'global_step_1'} "
                     "is intact (step 1, verified)"], proc.stderr[-3000:]
    assert "[Errno 28] No space left on device" in proc.stderr
    assert not list(ckpts.glob(".tmp-*")), "the partial save was left behind"
    assert sorted(p.name for p in ckpts.glob("global_step_*")) == ["global_step_1"]
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "1"
    report = verify_checkpoint(ckpts)
    assert report.ok, report.message()
    assert sorted(read_metrics(tmp_path / "run")) == [1]  # step 2 failed in its save: not logged
    pngs = assert_valid_pngs(tmp_path / "run" / "report")
    assert "reward.png" in {p.name for p in pngs}


def test_a_plot_that_cannot_be_written_leaves_no_empty_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = MetricTable.from_records([{"step": s, "time": float(s), "metrics": {"critic/score/mean": s / 4}}
                                      for s in (1, 2, 3)])
    assert assert_valid_pngs(tmp_path) == []
    written = write_plots(table, tmp_path)
    assert set(written) == {"reward"}
    before = (tmp_path / "reward.png").read_bytes()

    def full_disk(self, fname, **kwargs):  # a full disk: the file is created, nothing fits
        Path(fname).write_bytes(b"")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(fname))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    with pytest.raises(OSError) as caught:
        write_plots(table, tmp_path)
    assert is_disk_full(caught.value)
    assert (tmp_path / "reward.png").read_bytes() == before  # the earlier complete plot, untouched
    (tmp_path / "reward.png").unlink()
    with pytest.raises(OSError):
        write_plots(table, tmp_path)
    assert list(tmp_path.iterdir()) == [], "an empty or temporary PNG was left"


def test_disk_full_is_recognised_through_a_worker_error() -> None:
    remote = RayTaskError("save_checkpoint", "Traceback ...", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "x"))
    wrapped = WorkerError("hybrid_actor rank 1 raised in actor.save_checkpoint()")
    wrapped.__cause__ = remote
    assert is_disk_full(wrapped)
    assert is_disk_full(WorkerError("rank 0 raised: OSError: [Errno 28] No space left on device: '/ckpt/x'"))
    other = WorkerError("rank 0 raised: OSError: [Errno 13] Permission denied")
    other.__cause__ = RayTaskError("save_checkpoint", "Traceback ...", PermissionError(errno.EACCES, "denied"))
    assert not is_disk_full(other)


def test_first_save_on_a_full_disk_says_there_is_no_earlier_checkpoint(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("trainer: {}\n")
    dirs = CheckpointDirs(tmp_path / "ckpts")
    checkpointer = TrainerCheckpointer(dirs, {}, config)

    def full_disk(src, dst, *args, **kwargs):  # a stand-in for a full disk: the copy of the config
        Path(dst).write_bytes(b"tra")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    monkeypatch.setattr(shutil, "copy", full_disk)
    with pytest.raises(CheckpointError) as caught:
        checkpointer.save(3, {"global_step": 3})
    first = str(caught.value).splitlines()[0]
    assert first == (f"No space left on device while saving checkpoint {dirs.root / 'global_step_3'}; the partial "
                     "save was removed; there is no earlier checkpoint to resume from")
    assert list(dirs.root.iterdir()) == []
    with pytest.raises(CheckpointError, match="not a temporary checkpoint dir"):
        dirs.discard(tmp_path)
