"""SIGKILL of the whole run right after a checkpoint is committed, before anything else: the step's
metrics line (its validation included) and its memory-trace line are already written, so the resumed
run logs every step once, as an uninterrupted run does. Before, the checkpoint was committed first
and the line written after the validation's memory probes were read: a kill in between resumed at
the next step, and the step's metrics (`val/*` too) were never logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fault_scenarios import logged_steps, run_train
from test_train_e2e import read_metrics, task_dir, write_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).with_name("kill_after_commit_driver.py")
COMMON = ("trainer.total_training_steps=3", "trainer.save_freq=2", "trainer.test_freq=2",
          "actor.megatron.tensor_model_parallel_size=1", "resources.actor_pool.devices_per_node=1")


def memory_trace_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "memory_phases.jsonl").read_text().splitlines()
    return sorted(json.loads(line)["step"] for line in lines if line.strip())


def test_a_kill_right_after_the_commit_keeps_the_steps_metrics(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    config = write_config(tmp_path, task_dir)
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    killed = subprocess.run([sys.executable, str(DRIVER), "2", str(config), *COMMON], capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=tmp_path,
                            start_new_session=True)
    assert killed.returncode == -9 and "killing the run" in killed.stderr, killed.stderr[-3000:]
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "2"
    # The checkpoint of step 2 is the one a rerun continues from: its line is there already.
    assert logged_steps(run_dir) == [1, 2]
    assert memory_trace_steps(run_dir) == [1, 2]

    rerun = run_train(config, *COMMON)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming from {ckpts / 'global_step_2'}" in rerun.stderr
    assert logged_steps(run_dir) == [1, 2, 3]
    assert memory_trace_steps(run_dir) == [1, 2, 3]
    metrics = read_metrics(run_dir)
    for step in (2, 3):  # validated (test_freq 2, and the last step) and checkpointed
        assert "val/reward_mean" in metrics[step] and metrics[step]["timing_s/save_checkpoint"] > 0, step
        assert metrics[step]["timing_s/val"] > 0, step
