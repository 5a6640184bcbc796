"""Stops what is left of a local Ray cluster when the driver that started it dies without stopping it.

A driver killed with SIGKILL (its PID alone, say `kill -9 <pid>`, or the machine's OOM killer) runs no
cleanup. Ray's GCS and raylet then go soon, but its dashboard and runtime-env agents keep running
with parent PID 1 for about a minute (they retry reporting the raylet's death), and a worker that
raylet was still starting retries the dead GCS for a while. So a driver that starts a local cluster
first marks its own environment with a tag of that cluster (every process the cluster starts
inherits it), and starts this script in a session of its own with a pipe from the driver on its
stdin. The script waits for the pipe to close, which happens when the driver exits for any reason,
then kills every process carrying the tag until none has been seen for a moment. After a normal
shutdown there is nothing left to kill; after a SIGKILL it is the cleanup the driver could not do.

Run as a file (`python reaper.py TAG`), not as a module of the package, so that it imports neither
Ray nor torch: it is a small process that idles for the whole run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

TAG_ENV = "MEGARL_LOCAL_CLUSTER_TAG"  # in the environment of every process of one local cluster
QUIET_S = 2.0  # stop once no tagged process has been seen for this long
LIMIT_S = 120.0  # and in any case after this long


def tagged_processes(tag: str, env: str = TAG_ENV, exclude: int | None = None) -> list[psutil.Process]:
    """Live processes whose environment (as they were started) has `env` = `tag`, except `exclude`."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == exclude:
            continue
        try:
            if proc.environ().get(env) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def sweep(tag: str, quiet_s: float = QUIET_S, limit_s: float = LIMIT_S) -> int:
    """SIGKILL every process tagged `tag` (new ones too: a dying raylet may still start workers)
    until none has been seen for `quiet_s`, or `limit_s` passed. Returns how many were killed."""
    killed: set[int] = set()
    start = last_seen = time.monotonic()
    while time.monotonic() - last_seen < quiet_s and time.monotonic() - start < limit_s:
        found = tagged_processes(tag, exclude=os.getpid())
        if found:
            last_seen = time.monotonic()
        for proc in found:
            try:
                proc.send_signal(signal.SIGKILL)
                killed.add(proc.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.1)
    return len(killed)


def start_reaper(tag: str) -> subprocess.Popen:
    """Start this script for the cluster tagged `tag`: it sweeps once the returned process's stdin
    closes, i.e. when the caller exits or closes it. In a session of its own, so that a signal to
    the driver's process group does not take it along; without the tag itself."""
    env = {key: value for key, value in os.environ.items() if key != TAG_ENV}
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), tag], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True, close_fds=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: reaper.py TAG", file=sys.stderr)
        return 2
    sys.stdin.buffer.read()  # returns at EOF: the driver closed the pipe or died
    sweep(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
