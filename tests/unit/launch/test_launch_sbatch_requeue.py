"""megarl.sbatch's stop and requeue: SLURM's SIGTERM ahead of the time limit (--signal=B:TERM@300) goes to
node 0's bootstrap.py alone, not to srun (which would signal every process of the step, Ray's too), and a
trainer that stopped with EXIT_STOPPED_FOR_RESUME gets the job requeued (`scontrol requeue`).

The batch script runs for real (bash); what cannot exist here is stood in for: `srun` (runs the task
command once, as on a one-node allocation, and forwards SIGTERM to it as srun does), `scontrol` (records
its arguments), and node 0's bootstrap.py, which plays its part of the contract (bootstrap.pid and
trainer.status in MEGARL_JOB_STATE_DIR; the real one is run in tests/integration/launch).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.trainer.loop import EXIT_STOPPED_FOR_RESUME

REPO = Path(__file__).resolve().parents[3]
SBATCH = REPO / "launch" / "slurm" / "megarl.sbatch"

SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
"$@" &
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
"""
# Node 0's bootstrap.py, as megarl.sbatch sees it. FAKE_NODE0: "exit:N" = the trainer ended with N; "stop" =
# leave the pid, then on SIGTERM stop the trainer with a checkpoint (status 75); "nopid" = as "stop" but
# without leaving the pid (node 0 on another host), killed by the signal.
NODE0 = """
import os, signal, sys, time
log, mode = os.environ["FAKE_LOG"], os.environ["FAKE_NODE0"]
state = os.environ.get("MEGARL_JOB_STATE_DIR") or log  # set by the batch script (a fallback: tests of old scripts)

def leave(name, value):
    with open(os.path.join(state, name), "w") as f:
        f.write(f"{value}\\n")

if mode.startswith("exit:"):
    leave("trainer.status", mode[5:])
    sys.exit(int(mode[5:]))
received = []
if mode == "stop":
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    leave("bootstrap.pid", os.getpid())
open(os.path.join(log, "ready"), "w").close()
while not received:
    time.sleep(0.01)
time.sleep(0.3)  # the trainer finishes its step and writes its checkpoint
with open(os.path.join(log, "node0_signals"), "w") as f:
    f.write(str(len(received)))
leave("trainer.status", 75)
sys.exit(75)
"""


def fake_slurm(tmp_path: Path, node0: str, job_id: str | None = "4242") -> tuple[dict[str, str], Path]:
    home, bin_dir, log = tmp_path / "home", tmp_path / "bin", tmp_path / "log"
    (home / "launch" / "slurm").mkdir(parents=True)
    (home / "launch" / "slurm" / "bootstrap.py").write_text(NODE0)
    for directory in (bin_dir, log, tmp_path / "tmp"):
        directory.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "TMPDIR": str(tmp_path / "tmp"),
           "MEGARL_HOME": str(home), "MEGARL_PYTHON": sys.executable, "FAKE_LOG": str(log), "FAKE_NODE0": node0,
           "SLURM_JOB_NUM_NODES": "1", "SLURM_CPUS_ON_NODE": "1", "RAY_AUTH_TOKEN": "0" * 64}
    if job_id is not None:
        env["SLURM_JOB_ID"] = job_id
    return env, log


def start_batch(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(SBATCH), "cfg.yaml"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_until_ready(batch: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while not (log / "ready").exists():
        assert batch.poll() is None, batch.communicate()
        assert time.monotonic() < deadline, "node 0 never started"
        time.sleep(0.01)


def finish(batch: subprocess.Popen) -> str:
    try:
        return batch.communicate(timeout=60)[1]
    finally:
        if batch.poll() is None:
            os.killpg(batch.pid, signal.SIGKILL)
            batch.wait()


def test_sigterm_stops_the_trainer_through_node0_alone_and_requeues_the_job(tmp_path: Path) -> None:
    env, log = fake_slurm(tmp_path, "stop")
    batch = start_batch(env)
    wait_until_ready(batch, log)
    batch.send_signal(signal.SIGTERM)  # SLURM: --signal=B:TERM@300 signals the batch shell only
    stderr = finish(batch)
    assert batch.returncode == EXIT_STOPPED_FOR_RESUME, stderr
    assert (log / "node0_signals").read_text() == "1"
    assert not (log / "srun_signals").exists(), "srun was signalled: every process of the step, Ray's too, gets it"
    assert (log / "scontrol").read_text().splitlines() == ["requeue 4242"]
    assert "requeueing job 4242" in stderr
    assert list((tmp_path / "tmp").iterdir()) == []  # MEGARL_JOB_STATE_DIR removed


@pytest.mark.parametrize("status", [0, 1, 143])
def test_a_run_that_did_not_stop_for_a_resume_is_not_requeued(tmp_path: Path, status: int) -> None:
    env, log = fake_slurm(tmp_path, f"exit:{status}")
    batch = start_batch(env)
    stderr = finish(batch)
    assert batch.returncode == status, stderr
    assert not (log / "scontrol").exists()


def test_outside_slurm_a_stop_for_a_resume_says_to_rerun(tmp_path: Path) -> None:
    env, log = fake_slurm(tmp_path, f"exit:{EXIT_STOPPED_FOR_RESUME}", job_id=None)
    batch = start_batch(env)
    stderr = finish(batch)
    assert batch.returncode == EXIT_STOPPED_FOR_RESUME, stderr
    assert not (log / "scontrol").exists()
    assert "not under SLURM" in stderr and "run the same command again" in stderr


def test_without_node0_on_this_host_sigterm_stops_the_step(tmp_path: Path) -> None:
    env, log = fake_slurm(tmp_path, "nopid")
    batch = start_batch(env)
    wait_until_ready(batch, log)
    batch.send_signal(signal.SIGTERM)
    stderr = finish(batch)
    assert batch.returncode == 128 + signal.SIGTERM, stderr
    assert (log / "srun_signals").read_text() == "TERM\n"
    assert not (log / "scontrol").exists()
    assert "node 0's bootstrap.py is not running on this host" in stderr


def test_sbatch_header_allows_the_requeue_and_leaves_the_stop_its_time() -> None:
    text = SBATCH.read_text()
    directives = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")]
    assert "--requeue" in directives
    assert "--open-mode=append" in directives  # the requeued run's output follows the first's
    signal_lead = int(next(d for d in directives if d.startswith("--signal=B:TERM@")).rsplit("@", 1)[1])
    sys.path.insert(0, str(REPO / "launch" / "slurm"))
    from node_plan import DEFAULT_STOP_TIMEOUT_S

    assert DEFAULT_STOP_TIMEOUT_S + 30 <= signal_lead, "the trainer's stop must leave time for the Ray teardown"
    assert f"EXIT_STOPPED_FOR_RESUME={EXIT_STOPPED_FOR_RESUME}\n" in text
