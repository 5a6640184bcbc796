"""The process sandbox stops and names each kind of runaway code, and the environment is empty."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megarl.agent import sandbox
from megarl.agent.sandbox import SandboxLimits, network_isolation_supported, process_limit_supported, run_python
from megarl.agent.tools import PythonTool

pytestmark = pytest.mark.unit

LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=4, memory_bytes=256 * 2**20, file_bytes=2**20, output_bytes=1000)


def test_plain_code_runs_in_a_scratch_directory() -> None:
    run = run_python("import os\nopen('f.txt', 'w').write('hi')\nprint(sorted(os.listdir('.')))", LIMITS)
    assert run.ok and run.stdout.strip() == "['f.txt', 'main.py']", run.stderr


@pytest.mark.parametrize("code, limit", [
    ("while True: pass", "cpu_time"),
    ("import time\ntime.sleep(60)", "wall_time"),
    ("x = bytearray(2**30)\nprint('allocated')", "memory"),
    ("open('big', 'wb').write(b'x' * 8 * 2**20)\nprint('written')", "file_size"),
    ("import os\nprint('child', os.fork())", "processes"),
    ("import threading\nthreading.Thread(target=print, args=('ran',)).start()", "processes"),
])
def test_runaway_code_is_stopped_and_named(code: str, limit: str) -> None:
    if limit == "processes" and not process_limit_supported():
        pytest.skip("running as root without a Python the nobody user may run: no process limit here")
    run = run_python(code, LIMITS)
    assert run.stopped_by == limit, (run.exit_code, run.stderr[-300:])
    assert not run.ok and "allocated" not in run.stdout and "written" not in run.stdout and "child" not in run.stdout
    assert run.seconds < LIMITS.wall_seconds + 2


def test_environment_is_empty_and_output_is_capped() -> None:
    os.environ["MEGARL_SANDBOX_SECRET"] = "token"
    try:
        run = run_python("import os\nprint(sorted(k for k in os.environ if not k.startswith('LC_')))", LIMITS)
    finally:
        del os.environ["MEGARL_SANDBOX_SECRET"]
    assert run.ok and run.stdout.strip() == "[]"
    long = run_python("print('x' * 5000)", LIMITS)
    assert len(long.stdout) < 1100 and long.stdout.endswith("[output truncated]")


@pytest.mark.skipif(not network_isolation_supported(), reason="no network namespaces on this machine")
def test_no_network_where_namespaces_exist() -> None:
    run = run_python("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=2)\nprint('connected')", LIMITS)
    assert "connected" not in run.stdout and run.isolation["network"]
    assert "unreachable" in run.stderr or "refused" in run.stderr


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="sandbox limit cpu_seconds must be positive"):
        SandboxLimits(cpu_seconds=0)


def test_runs_from_a_thread_pool_start_without_python_code_between_fork_and_exec(monkeypatch) -> None:
    """Tool calls run on threads; `preexec_fn` (Python code in the forked child of a threaded
    process) can deadlock there, so the limits are set by a launcher after exec instead."""
    popen = subprocess.Popen
    seen: list[dict] = []

    def recording_popen(*args, **kwargs):
        seen.append(kwargs)
        return popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    with ThreadPoolExecutor(6) as pool:
        runs = list(pool.map(lambda i: run_python(f"print({i} * 7)", LIMITS), range(12)))
    assert [r.stdout.strip() for r in runs] == [str(i * 7) for i in range(12)]
    assert seen and not any(kw.get("preexec_fn") for kw in seen)


def test_the_code_inherits_no_descriptor_beyond_its_standard_streams() -> None:
    run = run_python("import os\nprint(sorted(int(f) for f in os.listdir('/proc/self/fd')))", LIMITS)
    assert run.ok, run.stderr
    fds = eval(run.stdout)  # noqa: S307 - the list the code printed
    assert fds[:3] == [0, 1, 2] and len(fds) == 4  # the fourth: the directory listing itself


def test_a_run_that_cannot_start_says_why(monkeypatch) -> None:
    monkeypatch.setattr(sandbox, "_interpreter", lambda drop_to: ("/nonexistent/python3", None))
    with pytest.raises(OSError, match="sandbox: the run could not start .*FileNotFoundError"):
        run_python("print(1)", LIMITS)


# A fresh process (the interpreter lookup is cached per process): the first runs, started together from
# a thread pool as the agent loop's tool calls are, must each wait for the lookup, not read an unfinished
# one as "no Python for nobody" and run the code as root without a process limit.
_FIRST_RUNS_TOGETHER = """
import concurrent.futures, json
from megarl.agent import sandbox
from megarl.agent.sandbox import SandboxLimits, run_python
limits = SandboxLimits(wall_seconds=30)
with concurrent.futures.ThreadPoolExecutor(6) as pool:
    runs = list(pool.map(lambda _: run_python("import os;print(os.getuid())", limits), range(6)))
print(json.dumps({"uids": [r.stdout.strip() for r in runs], "isolation": [r.isolation for r in runs],
                  "nobody_python": sandbox._interpreter(sandbox._nobody())[1] is not None}))
"""


def test_the_first_concurrent_runs_as_root_all_drop_to_nobody() -> None:
    if os.geteuid() != 0:
        pytest.skip("not running as root: the code runs as this user, there is no drop to nobody to race on")
    nobody = sandbox._nobody()
    if nobody is None:
        pytest.skip("no nobody user on this machine")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", _FIRST_RUNS_TOGETHER], capture_output=True, text=True, env=env,
                           cwd=root, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    if not seen["nobody_python"]:
        pytest.skip("no Python here that the nobody user may run: the code stays root (isolation says so)")
    assert seen["uids"] == [str(nobody[0])] * 6, seen
    assert all(i["unprivileged_user"] and i["process_limit"] for i in seen["isolation"]), seen["isolation"]


def test_identical_code_reads_identically_its_traceback_names_main_py() -> None:
    """Tracebacks name the script `main.py`, not its random scratch directory: a seeded run reproduces."""
    tool = PythonTool(timeout_s=5)
    first, second = (tool.call("e", {"code": "x = 1\nprint(1/0)"}) for _ in range(2))
    assert first.error == "exit_code" and first.text == second.text
    assert first.text.startswith('Traceback (most recent call last):\n  File "main.py", line 2, in <module>\n'), first.text
    assert "megarl_sandbox" not in first.text and first.text.endswith("ZeroDivisionError: division by zero")
    syntax = run_python("print(1/", LIMITS)
    assert syntax.stderr.startswith('  File "main.py", line 1\n') and "SyntaxError" in syntax.stderr, syntax.stderr
