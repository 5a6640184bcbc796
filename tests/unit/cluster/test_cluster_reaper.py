"""The reaper of a local cluster (megarl.cluster.reaper): when the pipe from its driver closes, it
kills every process carrying its cluster's tag, in whatever session or process group, new ones too,
and nothing else; while the pipe is open it kills nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from megarl.cluster.reaper import TAG_ENV, start_reaper

pytestmark = pytest.mark.unit


def _sleeper(tag: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != TAG_ENV}
    if tag is not None:
        env[TAG_ENV] = tag
    # Its own session, as Ray's workers are: a signal to a process group would not reach it.
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env, start_new_session=True)


def _gone_within(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_reaper_kills_its_clusters_processes_once_the_driver_is_gone() -> None:
    tag, other = uuid.uuid4().hex, uuid.uuid4().hex
    reaper = start_reaper(tag)
    mine = [_sleeper(tag), _sleeper(tag)]
    theirs, untagged = _sleeper(other), _sleeper(None)
    try:
        assert psutil.Process(reaper.pid).environ().get(TAG_ENV) is None  # never its own target
        time.sleep(1.0)
        assert all(p.poll() is None for p in mine), "killed while the driver was alive"
        reaper.stdin.close()  # what the driver's exit (even by SIGKILL) does to the pipe
        late = None
        assert _gone_within(mine[0], 10.0) and _gone_within(mine[1], 10.0)
        late = _sleeper(tag)  # started after the sweep began (a raylet starting a worker as it dies)
        assert _gone_within(late, 10.0)
        assert mine[0].returncode == -9 and late.returncode == -9
        assert _gone_within(reaper, 15.0) and reaper.returncode == 0
        assert theirs.poll() is None and untagged.poll() is None
    finally:
        for p in [*mine, theirs, untagged] + ([late] if late else []):
            if p.poll() is None:
                p.kill()
                p.wait()
        if reaper.poll() is None:
            reaper.kill()
