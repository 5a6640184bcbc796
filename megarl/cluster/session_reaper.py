"""Ends a local Ray cluster's processes when the driver that started it dies without cleaning up.

A driver killed by SIGKILL on its PID alone (the OOM killer, `kill -9 PID`) cannot call
`ray.shutdown()`. Ray's GCS and raylet share the driver's fate, but the raylet's two agents
(dashboard agent, runtime-env agent) see the raylet die and then spend up to 60 s trying to report
it to the GCS that died with it (Ray 2.60: `publish_error_to_driver` with a fixed 60 s timeout),
orphaned under PID 1 all that time; so do processes the driver started that do not watch it.

`start_reaper` (called by `start_or_connect` for a cluster it starts) runs this file as a separate
process in its own session, reading a pipe whose write end only the driver holds. The driver sends
"stop" when it shuts the cluster down itself; an end of file without it means the driver died, and
the watcher kills at once what it knows of the driver's processes:
- every descendant of the driver it saw while polling (once a second; PID and start time, so a
  reused PID is never hit). Ray's agents and workers are found this way: they rewrite their
  command line and environment block (setproctitle), so nothing else identifies them;
- every process whose environment carries the cluster's tag (set before `ray.init`), which also
  finds a process started after the last poll.

The watcher runs as a script, not `python -m`, so it imports nothing of megarl (only psutil).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import psutil

TAG_ENV = "MEGARL_RAY_SESSION_TAG"
STOP = b"stop"


def start_reaper(tag: str) -> subprocess.Popen:
    """Start the watcher for processes tagged `tag` (the caller puts TAG_ENV=tag in its environment
    before starting them). The watcher itself does not carry the tag."""
    env = {key: value for key, value in os.environ.items() if key != TAG_ENV}
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), tag, str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, start_new_session=True)


def stop_reaper(watcher: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """The driver shut its cluster down itself: tell the watcher to exit without killing anything."""
    try:
        assert watcher.stdin is not None
        watcher.stdin.write(STOP)
        watcher.stdin.close()
    except (BrokenPipeError, OSError):  # the watcher is already gone: nothing to stop
        pass
    try:
        watcher.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        watcher.kill()
        watcher.wait()


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries TAG_ENV=tag, this process excluded."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        try:
            if proc.pid != me and proc.environ().get(TAG_ENV) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _say(text: str) -> None:
    try:  # stderr may be a pipe nobody reads any more
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (BrokenPipeError, OSError):
        pass


def descendants(pid: int) -> dict[int, float]:
    """{pid: start time} of the live descendants of `pid` ({} once it is gone)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    found = {}
    for proc in children:
        try:
            found[proc.pid] = proc.create_time()
        except psutil.NoSuchProcess:
            continue
    return found


def still_running(seen: dict[int, float]) -> list[psutil.Process]:
    """The processes of `seen` that are alive with the same start time (not a reused PID)."""
    alive = []
    for pid, started in seen.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return alive


def wait_for_driver(driver_pid: int, poll_s: float = 1.0) -> tuple[bool, dict[int, float]]:
    """Block until the driver closes the pipe. Returns (stopped on purpose, descendants seen)."""
    stdin = sys.stdin.buffer.fileno()
    seen: dict[int, float] = {}
    received = b""
    while True:
        seen.update(descendants(driver_pid))
        ready, _, _ = select.select([stdin], [], [], poll_s)
        if ready:
            chunk = os.read(stdin, 64)
            if not chunk:
                return received.strip() == STOP, seen
            received += chunk


def main(tag: str, driver_pid: str) -> int:
    stopped, seen = wait_for_driver(int(driver_pid))
    if stopped:
        return 0
    me = os.getpid()
    victims = {proc.pid: proc for proc in still_running(seen) + tagged_processes(tag) if proc.pid != me}
    for proc in victims.values():
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(list(victims.values()), timeout=10)
    _say(f"megarl: driver {driver_pid} died without shutting down its Ray cluster; "
         f"killed {len(victims)} of its processes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
