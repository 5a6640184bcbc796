"""bootstrap.py's signal handling around the wait for the Ray nodes: a first SIGTERM starts the
teardown with further signals ignored, and leaving the wait must not arm the raising handler again.
On node 0 while the trainer runs: SIGTERM goes to the trainer alone, whose exit status (128 + N when
signal N ended it) is the bootstrap's and is left for megarl.sbatch.

`wait_for_nodes` runs against a stand-in `ray` module (no cluster), or is skipped: only the signal
handling and the exit statuses are under test, and the signals are real ones sent to this process.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import types
from pathlib import Path
from typing import Callable

import pytest

SLURM_DIR = Path(__file__).resolve().parents[3] / "launch" / "slurm"
sys.path.insert(0, str(SLURM_DIR))

import bootstrap  # noqa: E402
from node_plan import LaunchSettings, NodePlan  # noqa: E402
from slurm_env import LaunchError  # noqa: E402

PLAN = NodePlan(rank=0, host="head", is_head=True, head_address="127.0.0.1:6379", ray_start=["ray", "start"],
                expected_nodes=2, driver=["megarl", "train", "cfg.yaml"])


class Head:
    """A `subprocess.Popen` of the Ray head as far as `wait_for_nodes` looks at it."""

    def __init__(self, returncode: int | None = None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(signum)


def fake_ray(nodes: Callable[[], list[dict]]) -> types.ModuleType:
    """What `wait_for_nodes` uses of ray; `init` replaces the SIGTERM handler as ray.init does."""
    module = types.ModuleType("ray")
    module.shutdowns = 0

    def init(**kwargs: object) -> None:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def shutdown() -> None:
        module.shutdowns += 1

    module.init, module.nodes, module.shutdown = init, nodes, shutdown
    return module


@pytest.fixture(autouse=True)
def restore_signal_handlers():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGTERM, before[0])
    signal.signal(signal.SIGINT, before[1])


@pytest.fixture(autouse=True)
def gcs_port_open(monkeypatch):
    monkeypatch.setattr(bootstrap, "port_open", lambda address, timeout_s=1.0: True)
    monkeypatch.setattr(bootstrap, "POLL_S", 0.01)


def handlers() -> tuple[object, object]:
    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)


def test_sigterm_while_waiting_for_nodes_leaves_signals_ignored_for_the_teardown(monkeypatch):
    def nodes() -> list[dict]:
        os.kill(os.getpid(), signal.SIGTERM)  # scancel while the workers are still joining
        return [{"Alive": True}]

    ray = fake_ray(nodes)
    monkeypatch.setitem(sys.modules, "ray", ray)
    bootstrap.install_signal_handlers()
    with pytest.raises(bootstrap.Terminated) as caught:
        bootstrap.wait_for_nodes(PLAN, Head(), LaunchSettings(wait_timeout_s=30.0))
    assert caught.value.signum == signal.SIGTERM
    assert ray.shutdowns == 1
    # A second SIGTERM (SLURM sends one more before its kill) must not interrupt the teardown.
    assert handlers() == (signal.SIG_IGN, signal.SIG_IGN)
    os.kill(os.getpid(), signal.SIGTERM)  # ignored: the test goes on


def test_leaving_the_wait_without_a_signal_arms_the_handlers_again(monkeypatch):
    ray = fake_ray(lambda: [{"Alive": True, "NodeManagerAddress": "10.0.0.1"}])
    monkeypatch.setitem(sys.modules, "ray", ray)
    bootstrap.install_signal_handlers()
    with pytest.raises(LaunchError, match="exited with status 1 while waiting for workers"):
        bootstrap.wait_for_nodes(PLAN, Head(returncode=1), LaunchSettings(wait_timeout_s=30.0))
    assert ray.shutdowns == 1
    assert handlers() == (bootstrap._raise_terminated, bootstrap._raise_terminated)

    two = fake_ray(lambda: [{"Alive": True}, {"Alive": True}])
    monkeypatch.setitem(sys.modules, "ray", two)
    assert len(bootstrap.wait_for_nodes(PLAN, Head(), LaunchSettings(wait_timeout_s=30.0))) == 2
    assert two.shutdowns == 1
    assert handlers() == (bootstrap._raise_terminated, bootstrap._raise_terminated)


# ---------------------------------------------------------------- node 0: the trainer's exit status and its stop
# `run_head` with real processes: a stand-in Ray head (a process that sleeps) and stand-in trainers; only the
# wait for the Ray nodes is replaced (no cluster here).

TRAINER_STOPPING_ON_SIGTERM = """
import os, signal, sys, time
received = []
signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
open(sys.argv[1], "w").close()  # ready
while not received:
    time.sleep(0.01)
time.sleep(0.5)  # finishing the step and writing the checkpoint
with open(sys.argv[1], "w") as f:
    f.write(str(len(received)))
sys.exit(75)
"""


def head_plan(driver: list[str]) -> NodePlan:
    return NodePlan(rank=0, host="head", is_head=True, head_address="127.0.0.1:6379",
                    ray_start=[sys.executable, "-c", "import time; time.sleep(120)"], expected_nodes=1, driver=driver)


@pytest.fixture
def no_cluster_wait(monkeypatch):
    monkeypatch.setattr(bootstrap, "wait_for_nodes", lambda plan, head, settings: [{"Alive": True}])


def test_trainer_killed_by_a_signal_is_reported_as_128_plus_the_signal(no_cluster_wait, tmp_path: Path):
    killed = head_plan([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    settings = LaunchSettings(state_dir=str(tmp_path))
    assert bootstrap.run_head(killed, settings) == 128 + signal.SIGKILL  # 137, not 247 (sys.exit(-9))
    assert (tmp_path / "trainer.status").read_text() == "137\n"
    assert bootstrap.exit_status(-signal.SIGTERM) == 143 and bootstrap.exit_status(75) == 75


def test_sigterm_asks_the_trainer_alone_to_stop_and_passes_its_status_on(no_cluster_wait, tmp_path: Path):
    record = tmp_path / "trainer"
    plan = head_plan([sys.executable, "-c", TRAINER_STOPPING_ON_SIGTERM, str(record)])
    settings = LaunchSettings(state_dir=str(tmp_path), stop_timeout_s=60.0)

    def scancel_when_ready() -> None:
        deadline = time.monotonic() + 60
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # what megarl.sbatch sends node 0's bootstrap
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one does not cut the trainer's checkpoint short

    bootstrap.install_signal_handlers()
    sender = threading.Thread(target=scancel_when_ready)
    sender.start()
    try:
        code = bootstrap.run_head(plan, settings)
    finally:
        sender.join()
    assert code == 75
    assert record.read_text() == "1"  # the trainer got one SIGTERM, from the bootstrap
    assert (tmp_path / "trainer.status").read_text() == "75\n"


def test_a_trainer_that_does_not_stop_in_time_is_killed(no_cluster_wait, tmp_path: Path):
    ready = tmp_path / "ready"
    stubborn = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "open(sys.argv[1], 'w').close(); time.sleep(120)")
    plan = head_plan([sys.executable, "-c", stubborn, str(ready)])
    settings = LaunchSettings(stop_timeout_s=1.0)

    def signal_when_ready() -> None:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    bootstrap.install_signal_handlers()
    sender = threading.Thread(target=signal_when_ready)
    sender.start()
    started = time.monotonic()
    try:
        code = bootstrap.run_head(plan, settings)
    finally:
        sender.join()
    assert code == 128 + signal.SIGTERM
    assert time.monotonic() - started < 60
