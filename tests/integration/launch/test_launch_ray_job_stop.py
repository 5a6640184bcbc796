"""The graceful stop of a run submitted as a Ray job (what KubeRay's RayJob does, launch/k8s/): `ray job
stop` makes the job supervisor send the entrypoint SIGTERM and, RAY_JOB_STOP_WAIT_TIME_S later, SIGKILL.
With the wait the manifests set on the head, `megarl train` finishes its step, writes a checkpoint and
exits 75; a new job with the same trainer.default_local_dir continues from it.

For real on one machine: a Ray head started with `ray start` (dashboard and job server included), the
`ray job` CLI, and the real trainer (tiny GRPO on CPU). KubeRay itself cannot run here. Ray's processes
are never stopped with `ray stop` (other tests may run clusters on this machine): the fixture kills the
processes of this cluster's temp dir.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from megarl.trainer.checkpoint_dirs import LATEST_FILE
from megarl.trainer.checkpoint_verify import verify_checkpoint
from test_launch_slurm_requeue import leftovers, logged_steps
from test_launch_slurm_two_nodes import free_port, raylet_ports, write_experiment

pytestmark = pytest.mark.integration

RAY = str(Path(sys.executable).parent / "ray")


@pytest.fixture
def cluster() -> Iterator[tuple[Path, dict[str, str], str]]:
    """(work dir, environment of the `ray` CLI calls, job server address) of a fresh Ray head."""
    root = Path(tempfile.mkdtemp(prefix="mrj"))  # short: Ray's unix sockets live under its temp dir
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1",
           "RAY_JOB_STOP_WAIT_TIME_S": "300",  # launch/k8s: the head's env (Ray's default, 3 s, cuts a save short)
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    dashboard = free_port()
    try:
        started = subprocess.run(
            [RAY, "start", "--head", f"--port={free_port()}", f"--dashboard-port={dashboard}", "--include-dashboard=true",
             "--dashboard-host=127.0.0.1", f"--temp-dir={root / 'ray'}", "--num-cpus=4", *raylet_ports(head=True).split()],
            env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout[-4000:] + started.stderr[-4000:]
        yield root, env, f"http://127.0.0.1:{dashboard}"
    finally:
        for proc in leftovers(root / "ray"):
            try:
                proc.kill()
            except Exception:  # gone already
                pass
        shutil.rmtree(root, ignore_errors=True)


def ray_job(env: dict[str, str], address: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command, rest = args[0], args[1:]
    return subprocess.run([RAY, "job", command, "--address", address, *rest], env=env, capture_output=True,
                          text=True, timeout=timeout)


def submit_and_stop(root: Path, env: dict[str, str], address: str, job: str, after_step: int) -> tuple[str, str]:
    """Submit `megarl train` as job `job`; once it logged a step past `after_step`, `ray job stop` it.
    The job's final status and its log."""
    submitted = ray_job(env, address, "submit", "--submission-id", job, "--no-wait", "--",
                        sys.executable, "-m", "megarl.cli", "train", str(root / "experiment.yaml"),
                        "resources.ray_address=auto")
    assert submitted.returncode == 0, submitted.stderr[-4000:]
    deadline = time.monotonic() + 400
    while not [s for s in logged_steps(root / "run") if s > after_step]:
        status = ray_job(env, address, "status", job).stdout
        assert "RUNNING" in status or "PENDING" in status, ray_job(env, address, "logs", job).stdout[-8000:]
        assert time.monotonic() < deadline, f"no step past {after_step} in 400 s"
        time.sleep(0.5)
    stopped = ray_job(env, address, "stop", job, timeout=400)  # waits for the job to end
    assert stopped.returncode == 0, stopped.stdout[-4000:] + stopped.stderr[-4000:]
    return ray_job(env, address, "status", job).stdout, ray_job(env, address, "logs", job).stdout


def test_ray_job_stop_checkpoints_the_last_step_and_a_new_job_continues(cluster: tuple[Path, dict[str, str], str]
                                                                         ) -> None:
    root, env, address = cluster
    # Far more steps than run before the stop, and no periodic checkpoint: only the stop writes one.
    write_experiment(root, train_size=400, actor={},
                     trainer={"total_training_steps": 400, "save_freq": 1000, "default_local_dir": str(root / "run")})
    ckpts = root / "run" / "checkpoints"

    status, log = submit_and_stop(root, env, address, "megarl-1", after_step=0)
    first = logged_steps(root / "run")[-1]
    assert "was stopped" in status, status
    assert "megarl: received SIGTERM: stopping at the next step boundary" in log, log[-8000:]
    assert f"stopped by SIGTERM after step {first} (checkpoint {ckpts / f'global_step_{first}'}); exit status 75" in log
    assert "force-killed" not in log
    assert (ckpts / LATEST_FILE).read_text() == str(first)
    report = verify_checkpoint(ckpts / f"global_step_{first}")
    assert report.ok, report.message()

    # A new RayJob with the same trainer.default_local_dir: the run continues where the stop left it.
    status, log = submit_and_stop(root, env, address, "megarl-2", after_step=first)
    assert f"resuming from {ckpts / f'global_step_{first}'} (step {first}, verified)" in log, log[-8000:]
    steps = logged_steps(root / "run")
    assert steps[-1] > first and steps == list(range(1, steps[-1] + 1)), steps  # nothing trained twice
    assert (ckpts / LATEST_FILE).read_text() == str(steps[-1])
