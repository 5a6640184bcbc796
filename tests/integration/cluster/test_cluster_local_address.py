"""A run without `resources.ray_address` starts a Ray cluster of its own even when the environment
names another: RAY_ADDRESS set for some other purpose, or Ray's record of the last `ray start` on the
machine left behind after that cluster stopped (ray.init() without an address would try to join it
and fail)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

DRIVER = """
import ray
from megarl.cluster.ray_cluster import start_or_connect
with start_or_connect(num_cpus=1, object_store_memory_gb=0.1) as info:
    print("local", info.local, "cpus", ray.cluster_resources()["CPU"], flush=True)
"""


def test_a_local_cluster_ignores_a_ray_address_in_the_environment() -> None:
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:9")  # nothing listens there
    done = subprocess.run([sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "local True cpus 1.0" in done.stdout
