"""SIGTERM to a running `megarl train` (SLURM's `--signal=B:TERM@300` through launch/slurm, Kubernetes,
`kill`): the run stops at the next step boundary with a checkpoint of its last finished step, though
no periodic checkpoint was due, and exits with `EXIT_STOPPED_FOR_RESUME`; a second SIGTERM while
that checkpoint is written changes nothing; a rerun (trainer.resume_mode=auto) continues from it.
A SIGTERM while the run is still starting (Ray and the workers) stops it at once with the same
status: nothing was trained, so a launcher's requeue loses nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from fault_scenarios import logged_steps, run_train, start_train, tagged_processes, wait_for, worker_processes
from test_async_e2e import ASYNC
from megarl.trainer.checkpoint_dirs import LATEST_FILE
from megarl.trainer.checkpoint_verify import verify_checkpoint
from megarl.trainer.loop import EXIT_STOPPED_FOR_RESUME
from test_train_e2e import task_dir, write_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

STEPS = 400  # far more than run before the signal: the stop, not the end, ends the run
NO_PERIODIC_SAVE = "trainer.save_freq=1000"


@contextmanager
def killed_if_left(driver: subprocess.Popen) -> Iterator[None]:
    """The block's driver process is killed if still running when the block ends (a failed wait)."""
    try:
        yield
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def saving(ckpts: Path) -> bool:
    """The stop's checkpoint is being written: its temporary dir holds the actor's engine dir."""
    return ckpts.is_dir() and any(p.name.startswith("actor") for p in ckpts.glob(".tmp-step_*/*"))


# Synchronous in `make test`; one step off the policy (the next step's generation is in flight at most
# step boundaries: the stop lets one more step run without launching another) with `make test-slow`.
@pytest.mark.parametrize("mode", ["sync", pytest.param("one_step_off", marks=pytest.mark.slow)])
def test_sigterm_checkpoints_the_last_step_and_a_rerun_continues(tmp_path: Path, task_dir: Path,  # noqa: F811
                                                                 mode: str) -> None:
    config = write_config(tmp_path, task_dir, **(ASYNC if mode == "one_step_off" else {}))
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    driver = start_train(config, f"trainer.total_training_steps={STEPS}", NO_PERIODIC_SAVE,
                         "tracking.backends=[jsonl,console,mlflow]")
    with killed_if_left(driver):
        wait_for(lambda: len(logged_steps(run_dir)) >= 1, driver, "step 1 was logged", timeout_s=300)
        driver.send_signal(signal.SIGTERM)
        # The second signal lands while the checkpoint is written (it takes ~0.5 s here; polled every 2 ms).
        deadline = time.monotonic() + 60
        while not saving(ckpts) and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        second_during_save = saving(ckpts)
        if second_during_save:
            driver.send_signal(signal.SIGTERM)
        _, stderr = driver.communicate(timeout=120)
    assert driver.returncode == EXIT_STOPPED_FOR_RESUME, stderr[-6000:]
    assert second_during_save, "the checkpoint of the stop was not caught being written"
    assert "received SIGTERM again: ignored" in stderr

    steps = logged_steps(run_dir)
    last = steps[-1]
    assert 1 <= last < STEPS and steps == list(range(1, last + 1)), steps  # every step up to the stop, logged
    assert f"stopped by SIGTERM after step {last} (checkpoint {ckpts / f'global_step_{last}'})" in stderr
    assert (ckpts / LATEST_FILE).read_text() == str(last)
    assert sorted(p.name for p in ckpts.iterdir()) == [f"global_step_{last}", LATEST_FILE]  # nothing partial
    report = verify_checkpoint(ckpts / f"global_step_{last}")
    assert report.ok, report.message()
    # mlflow marks the run cut short (KILLED), not FAILED: it stopped as asked, with a checkpoint.
    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs] == ["KILLED"]

    rerun = run_train(config, f"trainer.total_training_steps={last + 1}", NO_PERIODIC_SAVE)
    assert rerun.returncode == 0, rerun.stderr[-6000:]
    assert f"resuming from {ckpts / f'global_step_{last}'} (step {last}, verified)" in rerun.stderr
    assert logged_steps(run_dir) == list(range(1, last + 2))
    assert (ckpts / LATEST_FILE).read_text() == str(last + 1)


def test_sigterm_while_the_workers_start_exits_for_a_requeue(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    config = write_config(tmp_path, task_dir)
    run_dir = tmp_path / "run"
    tag = f"start-stop-{os.getpid()}-{time.monotonic_ns()}"
    driver = start_train(config, f"trainer.total_training_steps={STEPS}", "tracking.backends=[jsonl,mlflow]", tag=tag)
    with killed_if_left(driver):
        # The workers' processes exist: Ray is up and the workers build their models and engines.
        wait_for(lambda: bool(worker_processes(driver)), driver, "the workers started", timeout_s=300)
        driver.send_signal(signal.SIGTERM)
        _, stderr = driver.communicate(timeout=120)
    assert driver.returncode == EXIT_STOPPED_FOR_RESUME, stderr[-6000:]
    # Stopped where the signal landed, or (its interrupt lost in a finalizer, where Python ignores
    # exceptions) at the first step boundary, as noted by start_or_connect: nothing trained either way.
    assert (("stopped by SIGTERM while the run was starting (nothing trained); exit status "
             f"{EXIT_STOPPED_FOR_RESUME}: a rerun with trainer.resume_mode=auto (the default) starts again from "
             "the start") in stderr or "stopped by SIGTERM after step 0 (no step trained yet)" in stderr), stderr[-6000:]
    assert "Traceback" not in stderr, stderr[-6000:]
    assert logged_steps(run_dir) == []
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    deadline = time.monotonic() + 30  # the cluster stopped with the driver: nothing of the run is left
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tagged_processes(tag) == []
    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs] == ["KILLED"]
