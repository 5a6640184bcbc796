"""Peak memory of a process tree: a grandchild's allocation is counted, Ray daemons are told apart."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

# The child starts a grandchild that touches 160 MiB, then both wait for stdin to close.
CHILD = textwrap.dedent(
    """
    import subprocess, sys
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import sys; b = bytearray(160 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    grandchild.stdout.readline()
    print("ready", flush=True)
    sys.stdin.read()
    grandchild.stdin.close()
    grandchild.wait()
    """
)


def test_peak_includes_grandchildren():
    from common import PeakMemorySampler

    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with PeakMemorySampler(proc.pid, interval_s=0.02) as mem:
            assert proc.stdout.readline().strip() == "ready"
            mem.sample()  # one sample while the grandchild surely holds its buffer
        proc.stdin.close()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    result = mem.result()
    assert result["workload_mib"] >= 160
    assert result["tree_mib"] >= result["workload_mib"]
    assert result["max_processes"] == 2
    assert result["samples"] >= 1


def test_sampler_of_a_finished_process_reports_zero():
    from common import PeakMemorySampler

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with PeakMemorySampler(proc.pid) as mem:
        mem.sample()
    assert mem.result()["workload_mib"] == 0


@pytest.mark.parametrize(
    "cmdline, daemon",
    [
        (["/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server", "--port=0"], True),
        (["/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet", "--node_ip_address=1"], True),
        (["python", "/venv/lib/python3.11/site-packages/ray/dashboard/dashboard.py"], True),
        (["ray::DashboardAgent"], True),
        (["python", "-u", "/venv/lib/python3.11/site-packages/ray/autoscaler/_private/monitor.py", "--logs-dir=/x"], True),
        (["ray::HostWorker"], False),
        (["python", "/venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py", "--node-ip-address=1",
          "--dashboard-agent-port=5", "--runtime-env-hash=1"], False),
        (["ray::IDLE"], False),
        (["python", "-m", "megarl.cli", "train", "configs/quickstart_cpu.yaml"], False),
    ],
)
def test_ray_daemons_are_recognised(cmdline, daemon):
    from common import is_ray_daemon

    assert is_ray_daemon(cmdline) is daemon
