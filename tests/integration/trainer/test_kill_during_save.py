"""SIGKILL of the driver (its whole process group) while a checkpoint is being written: the partial
checkpoint is never resumed from, the previous complete one verifies, and the next run resumes from
it with the same metrics as an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.trainer.checkpoint_verify import verify_checkpoint
from test_train_e2e import read_metrics, run_train, task_dir, write_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

COMMON = ("trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.max_ckpt_to_keep=3")
KEYS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean")


def test_kill_while_writing_a_checkpoint(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    straight = tmp_path / "straight"
    straight.mkdir()
    assert run_train(write_config(straight, task_dir), *COMMON).returncode == 0
    expected = read_metrics(straight / "run")

    killed = tmp_path / "killed"
    killed.mkdir()
    config = write_config(killed, task_dir)
    ckpts = killed / "run" / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", "train", str(config), *COMMON],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=killed, start_new_session=True)
    # The step-4 save has begun once its temporary directory holds the actor's partial engine dir.
    deadline = time.monotonic() + 600
    partial = []
    while not partial and proc.poll() is None and time.monotonic() < deadline:
        partial = [p for p in ckpts.glob(".tmp-step_4-*/*") if p.name.startswith("actor")] if ckpts.is_dir() else []
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert partial, "the run was not caught while writing its step-4 checkpoint"
    assert not (ckpts / "global_step_4").exists()
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "2"
    report = verify_checkpoint(ckpts)  # the root: the checkpoint the tracker file names
    assert report.ok, report.message()

    proc = run_train(config, *COMMON)
    assert proc.returncode == 0
    assert f"resuming from {ckpts / 'global_step_2'} (step 2, verified)" in proc.stderr
    assert not list(ckpts.glob(".tmp-*")), "the interrupted save was left behind"
    resumed = read_metrics(killed / "run")
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in KEYS:
            assert resumed[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-7), (step, key)
