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
