"""Ctrl-C and SIGTERM on the driver leave no worker, raylet or GCS process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megarl.cluster.session_reaper import TAG_ENV

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

DRIVER = Path(__file__).with_name("cleanup_driver.py")


@pytest.mark.parametrize("signum, exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_interrupted_driver_cleans_up_cluster_and_workers(signum, exit_code):
    driver = subprocess.Popen([sys.executable, str(DRIVER)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = driver.stdout.readline()
            assert line, "driver exited early:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("READY"):
                break
        worker_pids = [int(pid) for pid in line.split()[1:]]
        assert len(worker_pids) == 2
        processes = psutil.Process(driver.pid).children(recursive=True)
        names = " ".join(p.name() for p in processes)
        assert "raylet" in names and "gcs_server" in names
        assert set(worker_pids) <= {p.pid for p in processes}
        driver.send_signal(signum)
        assert driver.wait(timeout=120) == exit_code
        assert "CLEANING UP" in driver.stdout.read()
        _, alive = psutil.wait_procs(processes, timeout=60)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


# Without the session reaper, Ray's dashboard and runtime-env agents outlive a driver killed on its
# PID alone by about 60 s (their report of the raylet's death waits on the dead GCS); with it, they
# go as soon as the watcher sees the driver's pipe close.
KILLED_DRIVER_GONE_WITHIN_S = 20.0


def test_sigkill_of_the_driver_pid_alone_leaves_no_process_behind():
    driver = subprocess.Popen([sys.executable, str(DRIVER)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        line = ""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not line.startswith("READY"):
            line = driver.stdout.readline()
            assert line, "driver exited early:\n" + driver.stderr.read()
        processes = psutil.Process(driver.pid).children(recursive=True)
        names = {p.name() for p in processes}
        assert {"raylet", "gcs_server"} <= names, names
        agents = [p for p in processes if "Agent" in " ".join(p.cmdline())]
        assert len(agents) == 2, [p.cmdline() for p in processes]  # dashboard and runtime-env agents
        killed = time.monotonic()
        driver.kill()  # SIGKILL to the driver's PID only: nothing of it runs any more
        driver.wait(timeout=30)
        _, alive = psutil.wait_procs(processes, timeout=KILLED_DRIVER_GONE_WITHIN_S)
        alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        gone_s = time.monotonic() - killed
        assert not alive, f"still running {gone_s:.0f} s after the kill: {[(p.pid, p.name()) for p in alive]}"
        print(f"all {len(processes)} processes of the killed driver gone {gone_s:.1f} s after the kill")
        assert "died without shutting down its Ray cluster" in driver.stderr.read()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for proc in psutil.process_iter():  # never leave a failed case's agents to later tests
            try:
                if proc.environ().get(TAG_ENV, "").startswith(f"{driver.pid}-"):
                    proc.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
