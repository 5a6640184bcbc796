"""Run untrusted Python (a model's tool call) in a separate, limited process.

What each run gets:
- its own process (a new session, so the whole group is killed on timeout), started with `python -I`
  (no user site, no PYTHON* variables) and an empty environment;
- a fresh scratch directory as its working directory, deleted afterwards; the code is its `main.py`,
  and tracebacks name it so, not by the directory's random path (identical runs read alike);
- resource limits set in the child before it executes the interpreter (by a launcher, not in the
  calling process, which may be threaded): CPU seconds (RLIMIT_CPU), address space
  (RLIMIT_AS), size of any file it writes (RLIMIT_FSIZE), number of processes (RLIMIT_NPROC: no
  fork or thread that needs a new task beyond the limit), no core dumps;
- a wall-clock timeout on top of the CPU limit (a call that sleeps uses no CPU);
- no network where the kernel lets an unprivileged-capable process open a new network namespace
  (`unshare(CLONE_NEWNET)`, which needs root or user namespaces); `SandboxResult.isolation` says
  whether that happened;
- when started as root, the child drops to the `nobody` user, so it cannot read files only root may
  read and RLIMIT_NPROC applies (the kernel does not apply it to root). That needs a Python the
  `nobody` user may run (this one, or the system's); without one the child stays root and
  `SandboxResult.isolation["process_limit"]` says the process limit does not hold.

What it does not isolate: files readable by every user stay readable (there is no filesystem
namespace or chroot), the child sees the host's process list and kernel, and without network
namespaces it can open sockets. It is a guard against runaway and careless code, not a security
boundary against a determined attacker: run untrusted workloads in a container or VM as well.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. Bytes for memory, file size and output; seconds for CPU and wall time."""

    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_bytes: int = 512 * 2**20
    file_bytes: int = 4 * 2**20
    max_processes: int = 1
    output_bytes: int = 16 * 2**10
    isolate_network: bool = True

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds", "memory_bytes", "file_bytes", "max_processes", "output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox limit {name} must be positive, got {getattr(self, name)!r}")


@dataclass
class SandboxResult:
    """What a run printed and how it ended. `stopped_by` names the limit that ended it, if any:
    cpu_time | wall_time | memory | file_size | processes | killed; `exit_code` is negative for a
    signal."""

    stdout: str
    stderr: str
    exit_code: int
    stopped_by: Optional[str]
    seconds: float
    isolation: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.stopped_by is None


def _nobody() -> Optional[tuple[int, int]]:
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        return None
    return entry.pw_uid, entry.pw_gid


# The child's limits are set by a small launcher that then executes the interpreter running the code:
# the same process (limits and user survive exec), but no Python code runs between fork and exec in
# the calling process, which may be threaded (tool calls run on a thread pool), where `preexec_fn`
# can deadlock. A failure before the exec is written to `report_fd`, which the exec closes.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
spec = json.loads(sys.argv[1])
report = spec["report_fd"]
os.set_inheritable(report, False)
try:
    if spec["unshare_net"] and ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), "could not open a network namespace")
    # SIGXCPU at the soft limit; SIGKILL a second later if the code ignores it.
    resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu_seconds"], spec["cpu_seconds"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (spec["memory_bytes"], spec["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["file_bytes"], spec["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if spec["drop_to"] is not None:
        os.setgroups([])
        os.setgid(spec["drop_to"][1])
        os.setuid(spec["drop_to"][0])
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["max_processes"], spec["max_processes"]))
    os.execv(sys.argv[2], sys.argv[2:])
except BaseException as exc:
    os.write(report, f"{type(exc).__name__}: {exc}".encode())
    os._exit(127)
"""


# The code's script is `main.py` in its scratch directory. Python (3.9+) runs a script by its absolute
# path, so a traceback would name the random scratch directory and identical runs would read differently
# (a seeded multi-turn run is meant to reproduce). This runner, given to `python -c`, compiles the file
# under the name "main.py" and runs it as `__main__` (its own names deleted first), and leaves its own
# frame out of an uncaught exception's traceback: the code reads as if run by `python main.py`.
_RUNNER = r"""
import sys
def _shown_without_runner(kind, value, tb, shown=sys.excepthook):
    tb = tb.tb_next if tb is not None else None
    shown(kind, value.with_traceback(tb) if isinstance(value, BaseException) else value, tb)
sys.excepthook = _shown_without_runner
sys.argv[0] = __file__ = "main.py"
del sys, _shown_without_runner
exec(compile(open(__file__, "rb").read(), __file__, "exec"))
"""


def _launch(command: list[str], limits: SandboxLimits, drop_to: Optional[tuple[int, int]], unshare_net: bool,
            **popen: Any) -> tuple[subprocess.Popen, int]:
    """Start `command` under `limits` through the launcher; returns the process and the read end of
    its report pipe (see `_launch_failure`)."""
    read_fd, write_fd = os.pipe()
    spec = {"report_fd": write_fd, "unshare_net": unshare_net, "drop_to": drop_to, "cpu_seconds": limits.cpu_seconds,
            "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
            "max_processes": limits.max_processes}
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(spec), *command],
                                pass_fds=(write_fd,), close_fds=True, **popen)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return proc, read_fd


def _launch_failure(read_fd: int) -> Optional[str]:
    """What the launcher reported, once the process has ended: None when it reached the code."""
    with os.fdopen(read_fd, "rb") as report:
        message = report.read().decode("utf-8", errors="replace")
    return message or None


def _interpreter(drop_to: Optional[tuple[int, int]]) -> tuple[str, Optional[tuple[int, int]]]:
    """The Python that runs the code, and the user to drop to. As `nobody` the interpreter and its
    standard library must be readable by every user: this one often is not (a virtual environment
    under a private home), the system's may be. When none is, the child keeps this user.

    The lookup runs once per user, under a lock: tool calls run on a thread pool, and a thread that
    read an unfinished lookup as "none found" would run the code as root without a process limit."""
    if drop_to is None:
        return sys.executable, None
    key = drop_to
    with _INTERPRETERS_LOCK:
        if key not in _INTERPRETERS:
            _INTERPRETERS[key] = _interpreter_for(key)
        found = _INTERPRETERS[key]
    return (found, drop_to) if found is not None else (sys.executable, None)


def _interpreter_for(user: tuple[int, int]) -> Optional[str]:
    """The first Python that `user` may run with its standard library, or None."""
    for candidate in dict.fromkeys([sys.executable, getattr(sys, "_base_executable", sys.executable),
                                    "/usr/local/bin/python3", "/usr/bin/python3"]):
        if not os.path.exists(candidate):
            continue
        try:
            probe = subprocess.run([candidate, "-I", "-c", "import json, math, re"], capture_output=True, env={},
                                   timeout=30, user=user[0], group=user[1], extra_groups=[])
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return candidate
    return None


_INTERPRETERS: dict[tuple[int, int], Optional[str]] = {}  # user -> its Python (None: none found); under the lock
_INTERPRETERS_LOCK = threading.Lock()


def _can_unshare_net() -> bool:
    """Whether a child may open its own network namespace here (tried once, in a throwaway child)."""
    probe = subprocess.run([sys.executable, "-I", "-c",
                            "import ctypes,sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0)"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def process_limit_applies(drop_to: Optional[tuple[int, int]] = None) -> bool:
    """The kernel does not apply RLIMIT_NPROC to root: it holds unless the code runs as root."""
    return drop_to is not None or os.geteuid() != 0


def process_limit_supported() -> bool:
    """Whether a sandboxed run here gets a working process limit (root needs a Python that the
    `nobody` user may run)."""
    return process_limit_applies(_interpreter(_nobody() if os.geteuid() == 0 else None)[1])


_NET_SUPPORTED: Optional[bool] = None


def network_isolation_supported() -> bool:
    global _NET_SUPPORTED
    if _NET_SUPPORTED is None:
        _NET_SUPPORTED = _can_unshare_net()
    return _NET_SUPPORTED


# Messages by which the interpreter reports a limit it ran into (the limit, not the code, failed).
_LIMIT_MESSAGES = (("MemoryError", "memory"), ("File too large", "file_size"),
                   ("Resource temporarily unavailable", "processes"), ("can't start new thread", "processes"))


def _stopped_by(returncode: int, stderr: str, timed_out: bool) -> Optional[str]:
    if timed_out:
        return "wall_time"
    if returncode == -signal.SIGXCPU:
        return "cpu_time"
    if returncode == -signal.SIGKILL:
        return "killed"  # the CPU hard limit after an ignored SIGXCPU, or the kernel's OOM killer
    if returncode == -signal.SIGXFSZ:
        return "file_size"
    if returncode != 0:
        for message, limit in _LIMIT_MESSAGES:
            if message in stderr:
                return limit
    return None


def _read_capped(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    return text + ("\n[output truncated]" if len(data) > limit else "")


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a script in the sandbox described in the module docstring."""
    python, drop_to = _interpreter(_nobody() if os.geteuid() == 0 else None)
    unshare_net = limits.isolate_network and network_isolation_supported()
    scratch = tempfile.mkdtemp(prefix="megarl_sandbox_")
    outputs = tempfile.mkdtemp(prefix="megarl_sandbox_out_")  # outside the code's reach
    try:
        script = os.path.join(scratch, "main.py")
        with open(script, "w") as f:
            f.write(code)
        out_path, err_path = os.path.join(outputs, "stdout"), os.path.join(outputs, "stderr")
        if drop_to is not None:
            os.chown(scratch, *drop_to)
            os.chown(script, *drop_to)
        start = time.perf_counter()
        timed_out = False
        # Output goes to files the parent opened (the file-size limit applies to them too), so a
        # chatty call cannot fill a pipe and block.
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc, report = _launch([python, "-I", "-B", "-c", _RUNNER], limits, drop_to, unshare_net, cwd=scratch,
                                   env={}, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
            try:
                proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        failure = _launch_failure(report)
        if failure is not None:
            raise OSError(f"sandbox: the run could not start ({failure})")
        seconds = time.perf_counter() - start
        stdout = _read_capped(out_path, limits.output_bytes)
        stderr = _read_capped(err_path, limits.output_bytes)
        return SandboxResult(stdout=stdout, stderr=stderr, exit_code=proc.returncode,
                             stopped_by=_stopped_by(proc.returncode, stderr, timed_out), seconds=seconds,
                             isolation={"network": unshare_net, "unprivileged_user": drop_to is not None,
                                        "process_limit": process_limit_applies(drop_to),
                                        "empty_environment": True})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(outputs, ignore_errors=True)


__all__ = ["SandboxLimits", "SandboxResult", "network_isolation_supported", "process_limit_supported", "run_python"]
