"""Ctrl-C and SIGTERM on the driver leave no worker, raylet or GCS process behind; nor does a
SIGKILL of the driver's process group while raylet is starting a worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megarl.cluster.reaper import tagged_processes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

DRIVER = Path(__file__).with_name("cleanup_driver.py")
TAG_ENV = "MEGARL_TEST_RUN_TAG"
# A worker that was starting when the GCS died retries it for about 10 s (2 s a try, set by
# start_or_connect; with Ray's default of 5 s a try it took 25 s on an idle 2-core machine), unless
# the cluster's reaper kills it first (2.3 s).
STARTING_WORKER_GONE_S = 20.0


def _tagged(tag: str) -> list[psutil.Process]:
    return tagged_processes(tag, TAG_ENV)


def _name(proc: psutil.Process) -> str:
    """The process's name, or "" for one that ended since it was listed (Ray starts short-lived helpers)."""
    try:
        return proc.name()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ""


def _starting_worker(proc: psutil.Process) -> bool:
    try:
        return proc.name() == "python" and any("default_worker.py" in arg for arg in proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _read_until_ready(driver: subprocess.Popen) -> str:
    lines = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = driver.stdout.readline()
        assert line, "driver exited early:\n" + "".join(lines)
        lines.append(line)
        if line.startswith("READY"):
            return line
    raise AssertionError("driver not ready in 300 s:\n" + "".join(lines))


@pytest.mark.parametrize("signum, exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_interrupted_driver_cleans_up_cluster_and_workers(signum, exit_code):
    driver = subprocess.Popen([sys.executable, str(DRIVER)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        line = _read_until_ready(driver)
        worker_pids = [int(pid) for pid in line.split()[1:]]
        assert len(worker_pids) == 2
        processes = psutil.Process(driver.pid).children(recursive=True)
        names = " ".join(_name(p) for p in processes)
        assert "raylet" in names and "gcs_server" in names
        assert set(worker_pids) <= {p.pid for p in processes}
        driver.send_signal(signum)
        try:
            code = driver.wait(timeout=120)
        except subprocess.TimeoutExpired:  # say where it hangs: its output and every thread's stack
            driver.send_signal(signal.SIGUSR1)
            time.sleep(2)
            driver.kill()
            pytest.fail(f"driver still running 120 s after {signum.name}; its output:\n{driver.stdout.read()[-20000:]}")
        assert code == exit_code
        assert "CLEANING UP" in driver.stdout.read()
        _, alive = psutil.wait_procs(processes, timeout=60)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def test_sigkill_of_the_process_group_while_a_worker_starts_leaves_nothing_behind():
    tag = f"churn-{os.getpid()}-{time.monotonic_ns()}"
    driver = subprocess.Popen([sys.executable, str(DRIVER), "--churn"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env={**os.environ, "RAY_AUTH_MODE": "disabled", TAG_ENV: tag})
    try:
        _read_until_ready(driver)
        # Kill while a worker process is starting: it runs Ray's default_worker.py but has not yet
        # connected (nor renamed itself ray::...).
        deadline = time.monotonic() + 120
        while not any(_starting_worker(p) for p in _tagged(tag)):
            assert time.monotonic() < deadline, "no worker was seen starting in 120 s"
            time.sleep(0.02)
        before = {p.pid: _name(p) for p in _tagged(tag)}
        assert "raylet" in before.values() and "gcs_server" in before.values(), before
        os.killpg(driver.pid, signal.SIGKILL)
        killed = time.monotonic()
        driver.wait(timeout=60)
        left = _tagged(tag)
        while left and time.monotonic() - killed < STARTING_WORKER_GONE_S:
            time.sleep(0.2)
            left = _tagged(tag)
        gone_s = time.monotonic() - killed
        print(f"{len(before)} processes before the kill; the last one gone after {gone_s:.1f} s")
        assert not left, f"still running {STARTING_WORKER_GONE_S} s after the kill: " \
                         f"{[(p.pid, p.name(), p.cmdline()[:2]) for p in left]}"
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
