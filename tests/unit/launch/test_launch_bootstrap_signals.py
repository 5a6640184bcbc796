"""bootstrap.py's signal handling around the wait for the Ray nodes: a first SIGTERM starts the
teardown with further signals ignored, and leaving the wait must not arm the raising handler again.

`wait_for_nodes` runs against a stand-in `ray` module (no cluster): only its signal handling is
under test, and the signals are real ones sent to this process.
"""

from __future__ import annotations

import os
import signal
import sys
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
