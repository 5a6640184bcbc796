"""Scoring workers hold bad user code in: memory limit, process groups, captured output, batch deadline.

Each test writes a real reward file to tmp_path and runs it in the real pool (fresh interpreters).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from megarl.errors import ConfigError
from megarl.rewards import pool as pool_module
from megarl.rewards.pool import ScoringPool
from megarl.rewards.worker import ScoringTarget

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

USER_FILE = '''
import os
import subprocess
import sys
import time

_KEPT = []


def leaks(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "big":
        _KEPT.append(b"x" * (160 << 20))  # touched memory: resident at once
    return {"score": 1.0, "pid": os.getpid()}


def starts_children(data_source, solution_str, ground_truth, extra_info=None):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(ground_truth, "a") as pids:  # the test's list of every child started
        pids.write(f"{child.pid}\\n")
    if solution_str == "crash":
        os._exit(5)
    if solution_str == "hang":
        time.sleep(600)
    return {"score": 1.0, "child": child.pid}


def prints(data_source, solution_str, ground_truth, extra_info=None):
    print("user says hello", solution_str)
    print("and complains", file=sys.stderr)
    return 1.0


def sleeps(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(float(solution_str))
    return 1.0


def exits(data_source, solution_str, ground_truth, extra_info=None):
    os._exit(0)
'''


@pytest.fixture
def user_file(tmp_path: Path) -> str:
    path = tmp_path / "user_reward.py"
    path.write_text(USER_FILE)
    return str(path)


def call(text: str) -> tuple:
    return ("test", text, "1", None)


def is_gone(pid: int) -> bool:
    """True when no live process has ``pid`` (a zombie waiting for init counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def wait_gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if is_gone(pid):
            return True
        time.sleep(0.05)
    return False


def test_worker_over_its_memory_limit_is_replaced_and_the_call_is_a_crash(user_file: str) -> None:
    with ScoringPool(ScoringTarget(user_file, "leaks"), 1, 30.0, memory_mb=120) as p:
        outcomes = p.map([call("small"), call("big"), call("small")])
        assert p.restarts == 1
    assert [o.status for o in outcomes] == ["ok", "crash", "ok"]
    assert "memory limit of 120 MiB" in outcomes[1].reason and "worker_memory_mb" in outcomes[1].reason
    assert outcomes[0].result["pid"] != outcomes[2].result["pid"]  # the leaking worker was replaced
    # Without a limit the same call scores.
    with ScoringPool(ScoringTarget(user_file, "leaks"), 1, 30.0) as p:
        assert [o.status for o in p.map([call("big")])] == ["ok"]


def test_a_function_whose_import_is_over_the_limit_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "heavy_import.py"
    path.write_text("BLOB = b'x' * (160 << 20)\ndef f(**kw):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"memory limit of 100 MiB.*while loading") as error:
        ScoringPool(ScoringTarget(str(path), "f"), 1, 5.0, memory_mb=100)
    assert str(path) in str(error.value)


def test_children_of_the_user_function_die_with_their_worker(user_file: str, tmp_path: Path) -> None:
    pids = tmp_path / "children.txt"
    with ScoringPool(ScoringTarget(user_file, "starts_children"), 1, 1.0) as p:
        ok = p.map([("test", "ok", str(pids), None)])[0]
        assert ok.status == "ok"
        survivor = int(ok.result["child"])
        assert not is_gone(survivor)  # the worker is alive, so is what it started
        # A worker that crashes or hangs is killed with its whole process group.
        crashed = p.map([("test", "crash", str(pids), None), ("test", "hang", str(pids), None)])
        assert [o.status for o in crashed] == ["crash", "timeout"]
        assert "code 5" in crashed[0].reason
        assert p.restarts == 2
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 3 and survivor in started
    assert [pid for pid in started if not wait_gone(pid)] == [], "children outlived their workers"


def test_user_output_is_captured_counted_and_sampled_once(
    user_file: str, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.pool"):
        with ScoringPool(ScoringTarget(user_file, "prints"), 2, 5.0) as p:
            first = p.map([call(str(i)) for i in range(6)])
            after_first = p.output_bytes
            p.map([call("again")])
            after_second = p.output_bytes
    assert [o.status for o in first] == ["ok"] * 6
    each = len("user says hello 0\n") + len("and complains\n")
    assert after_first == 6 * each
    assert after_second == after_first + each + len("again") - 1
    out, err = capfd.readouterr()
    assert "user says hello" not in out + err and "complains" not in out + err
    warnings = [r for r in caplog.records if "wrote to stdout/stderr" in r.getMessage()]
    assert len(warnings) == 1 and "user says hello" in warnings[0].getMessage()
    assert "'prints'" in warnings[0].getMessage() and user_file in warnings[0].getMessage()


def test_batch_deadline_cancels_the_rest_as_timeouts(
    user_file: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Progress lines every 0.3 s instead of every 5 s, so that a short test sees them.
    monkeypatch.setattr(pool_module, "PROGRESS_AFTER_S", 0.3)
    monkeypatch.setattr(pool_module, "PROGRESS_EVERY_S", 0.3)
    with caplog.at_level(logging.INFO, logger="megarl.rewards.pool"):
        with ScoringPool(ScoringTarget(user_file, "sleeps"), 2, 30.0) as p:
            start = time.monotonic()
            outcomes = p.map([call("0")] * 2 + [call("5")] * 6, batch_timeout_s=1.5)
            elapsed = time.monotonic() - start
            # The cancelled workers were replaced: the next batch scores.
            assert [o.status for o in p.map([call("0")] * 3)] == ["ok"] * 3
    statuses = [o.status for o in outcomes]
    assert statuses[:2] == ["ok", "ok"] and statuses[2:] == ["timeout"] * 6
    assert all("1.5 s (reward.batch_timeout_s)" in o.reason for o in outcomes[2:])
    # 6 calls of 5 s on 2 workers would take 15 s; the deadline stops the batch at 1.5 s (+ restarts).
    assert elapsed < 10
    progress = [r.getMessage() for r in caplog.records if "reward scoring:" in r.getMessage()]
    assert progress and "2/8 calls done, 0 failed" in progress[0] and "batch deadline 1.5 s" in progress[0]


def test_os_exit_in_every_call_is_a_counted_crash(user_file: str) -> None:
    with ScoringPool(ScoringTarget(user_file, "exits"), 2, 5.0) as p:
        outcomes = p.map([call("x")] * 4)
        assert p.restarts == 4
    assert [o.status for o in outcomes] == ["crash"] * 4
    assert all("worker exited with code 0 during the call" in o.reason for o in outcomes)
