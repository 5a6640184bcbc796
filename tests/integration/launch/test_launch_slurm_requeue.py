"""SLURM's stop ahead of the time limit, for real but for SLURM itself: megarl.sbatch runs under bash with a
one-node allocation described by the SLURM variables, its srun running the real bootstrap.py, which
starts a real Ray head and the real `megarl train` (tiny GRPO on CPU). SIGTERM to the batch script
(what --signal=B:TERM@300 sends) must end in a checkpoint of the trainer's last step, exit status
EXIT_STOPPED_FOR_RESUME and `scontrol requeue`; the requeued job (the same script, command and
environment, run again) resumes from that checkpoint in the same run directory.

Stand-ins for what cannot run here: `srun` (runs the task once with SLURM_NODEID=0, forwards SIGTERM)
and `scontrol` (records its arguments). Ray's processes are never stopped with `ray stop` (other tests
may run clusters on this machine): MEGARL_RAY_STOP_ALL=0.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from megarl.trainer.checkpoint_dirs import LATEST_FILE
from megarl.trainer.checkpoint_verify import verify_checkpoint
from megarl.trainer.loop import EXIT_STOPPED_FOR_RESUME
from test_launch_slurm_two_nodes import free_port, raylet_ports, write_experiment

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
SBATCH = REPO / "launch" / "slurm" / "megarl.sbatch"
SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=0 SLURM_PROCID=0 "$@" &
task=$!
trap 'echo TERM >> "$FAKE_LOG/srun_signals"; kill -TERM "$task"' TERM
while :; do
    wait "$task" && exit 0
    status=$?
    kill -0 "$task" 2>/dev/null || exit "$status"
done
"""
SCONTROL = """#!/bin/sh
echo "$@" >> "$FAKE_LOG/scontrol"
[ "$1" = requeue ]  # `show hostnames` fails: bootstrap.py then reads SLURM_JOB_NODELIST itself
"""


@pytest.fixture
def workdir() -> Iterator[Path]:
    # Short paths: Ray puts unix sockets under its temp dir, and those are limited to ~107 bytes.
    root = Path(tempfile.mkdtemp(prefix="mrq"))
    try:
        yield root
    finally:
        for proc in leftovers(root / "ray"):
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(root, ignore_errors=True)


def leftovers(ray_temp: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(ray_temp) in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def requeues(fake_log: Path) -> list[str]:
    calls = (fake_log / "scontrol").read_text().splitlines() if (fake_log / "scontrol").is_file() else []
    return [call for call in calls if call.startswith("requeue")]


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def job_environment(root: Path) -> dict[str, str]:
    bin_dir, log = root / "bin", root / "log"
    for directory in (bin_dir, log, root / "tmp"):
        directory.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ}
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "RAY_ADDRESS", "SLURM_NODEID", "SLURM_PROCID"):
        env.pop(key, None)
    env.update({
        "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "TMPDIR": str(root / "tmp"), "FAKE_LOG": str(log),
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node01", "SLURM_JOB_NUM_NODES": "1", "SLURM_CPUS_ON_NODE": "2",
        "MEGARL_HOME": str(REPO), "MEGARL_PYTHON": sys.executable,
        "MEGARL_ENTRYPOINT": f"{sys.executable} -m megarl.cli train",
        "MEGARL_NODE_IPS": "127.0.0.1", "MEGARL_RAY_PORT": str(free_port()), "MEGARL_RAY_DASHBOARD": "0",
        "MEGARL_RAY_START_ARGS": raylet_ports(head=True), "MEGARL_RAY_TEMP_DIR": str(root / "ray"),
        "MEGARL_OBJECT_STORE_BYTES": str(80 * 2**20), "MEGARL_RAY_STOP_ALL": "0",
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        "OMP_NUM_THREADS": "1",
    })
    return env


def write_job_experiment(root: Path) -> Path:
    # Far more steps than run before the signal, and no periodic checkpoint: only the stop writes one; the
    # run directory relative to the submit directory, the same on a requeue.
    return write_experiment(root, train_size=400, actor={},
                            trainer={"total_training_steps": 400, "save_freq": 1000, "default_local_dir": "run"})


def run_job_until_stopped(root: Path, env: dict[str, str], after_step: int, log_name: str) -> tuple[int, str]:
    """Run the batch script from `root` (the submit directory) until the trainer logged a step past
    `after_step`, then send it SIGTERM as SLURM does; its exit status and output."""
    log_path = root / log_name
    with open(log_path, "w") as log:
        batch = subprocess.Popen(["bash", str(SBATCH), "experiment.yaml"], cwd=root, env=env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not [s for s in logged_steps(root / "run") if s > after_step]:
            assert batch.poll() is None, f"the job ended ({batch.returncode}) early:\n{log_path.read_text()[-8000:]}"
            assert time.monotonic() < deadline, f"no step past {after_step} in 400 s:\n{log_path.read_text()[-8000:]}"
            time.sleep(0.1)
        batch.send_signal(signal.SIGTERM)
        code = batch.wait(timeout=300)
    finally:
        if batch.poll() is None:
            os.killpg(batch.pid, signal.SIGKILL)
            batch.wait()
    return code, log_path.read_text()


def test_sigterm_to_the_batch_script_checkpoints_requeues_and_the_requeued_job_resumes(workdir: Path) -> None:
    root = workdir
    write_job_experiment(root)
    env = job_environment(root)
    run_dir, ckpts, fake_log = root / "run", root / "run" / "checkpoints", root / "log"

    code, output = run_job_until_stopped(root, env, after_step=0, log_name="job1.out")
    assert code == EXIT_STOPPED_FOR_RESUME, output[-8000:]
    first = logged_steps(run_dir)[-1]
    assert f"stopped by SIGTERM after step {first} (checkpoint {ckpts / f'global_step_{first}'})" in output
    assert (ckpts / LATEST_FILE).read_text() == str(first)
    report = verify_checkpoint(ckpts / f"global_step_{first}")
    assert report.ok, report.message()
    assert "trainer exited with status 75" in output
    assert not (fake_log / "srun_signals").exists(), "srun was signalled, and with it every process of the step"
    assert requeues(fake_log) == ["requeue 4242"]
    assert not leftovers(root / "ray"), "Ray processes left after the job"

    # The requeue: SLURM runs the same script with the same command and environment again.
    code, output = run_job_until_stopped(root, env, after_step=first, log_name="job2.out")
    assert code == EXIT_STOPPED_FOR_RESUME, output[-8000:]
    assert f"resuming from {ckpts / f'global_step_{first}'} (step {first}, verified)" in output
    steps = logged_steps(run_dir)
    second = steps[-1]
    assert second > first and steps == list(range(1, second + 1)), steps  # continued, nothing trained twice
    assert (ckpts / LATEST_FILE).read_text() == str(second)
    assert requeues(fake_log) == ["requeue 4242"] * 2
