"""What the launchers' SIGTERM does to the trainer's process: inside `stop_on_signal` (the training loop)
it asks for a stop instead of raising, however many times it comes; outside, the handler from before
is back. Real signals sent to this process."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from megarl.cluster.ray_cluster import stop_on_signal


def raise_system_exit(signum: int, frame: object) -> None:  # start_or_connect's handler: leave the block
    raise SystemExit(128 + signum)


@pytest.fixture(autouse=True)
def sigterm_raises():
    before = signal.signal(signal.SIGTERM, raise_system_exit)
    yield
    signal.signal(signal.SIGTERM, before)


def deliver(signum: int) -> None:
    """Send `signum` to this process and give Python the chance to run its handler."""
    os.kill(os.getpid(), signum)
    for _ in range(100):
        time.sleep(0.001)


def test_sigterm_inside_asks_for_a_stop_and_a_second_one_interrupts_nothing(capfd) -> None:
    with stop_on_signal() as stop:
        assert not stop.requested
        deliver(signal.SIGTERM)
        assert stop.requested and stop.signum == signal.SIGTERM and stop.signal_name == "SIGTERM"
        deliver(signal.SIGTERM)  # e.g. while the checkpoint is written: no exception cuts it short
        assert stop.received == 2 and stop.signum == signal.SIGTERM
    err = capfd.readouterr().err
    assert "received SIGTERM: stopping at the next step boundary" in err
    assert "received SIGTERM again: ignored" in err
    # The stop is under way: a late signal during the shutdown that follows changes nothing either.
    deliver(signal.SIGTERM)
    assert stop.received == 3


def test_leaving_without_a_stop_restores_the_handler_from_before() -> None:
    with stop_on_signal() as stop:
        pass
    assert not stop.requested
    assert signal.getsignal(signal.SIGTERM) is raise_system_exit
    with pytest.raises(SystemExit) as leaving:
        deliver(signal.SIGTERM)
    assert leaving.value.code == 128 + signal.SIGTERM


def test_outside_the_main_thread_nothing_is_installed() -> None:
    seen = {}

    def body() -> None:
        with stop_on_signal() as stop:
            seen["handler"] = signal.getsignal(signal.SIGTERM)
            seen["requested"] = stop.requested

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert seen == {"handler": raise_system_exit, "requested": False}


def test_a_sigterm_received_before_the_block_is_a_stop_asked_for(capfd) -> None:
    # start_or_connect's handler noted it (ClusterInfo.sigterm), but the interrupt it raised was lost
    # (raised inside a finalizer, where Python ignores exceptions): the loop still stops at its first boundary.
    with stop_on_signal(pending=[signal.SIGTERM]) as stop:
        assert stop.requested and stop.signum == signal.SIGTERM and stop.received == 1
        deliver(signal.SIGTERM)  # and a later one is ignored as usual
        assert stop.received == 2
    assert "received SIGTERM: stopping at the next step boundary" in capfd.readouterr().err
    with stop_on_signal(pending=[]) as stop:
        assert not stop.requested
