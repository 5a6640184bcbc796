"""Timer: phase durations per step, nesting, repeats, reset on pop."""

from __future__ import annotations

import pytest

from megarl.trainer.timing import Timer

pytestmark = pytest.mark.unit


class FakeClock:
    """Time advances only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_nested_and_repeated_phases() -> None:
    clock = FakeClock()
    timer = Timer(clock=clock)
    with timer("step"):
        with timer("gen"):
            clock.now += 2.0
        with timer("update_actor"):
            assert timer.open_phases == ["step", "update_actor"]
            clock.now += 1.5
        with timer("gen"):  # a second generation round in the same step adds up
            clock.now += 0.5
        clock.now += 0.25  # time outside any inner phase counts for "step" only
    assert timer.pop() == {"step": 4.25, "gen": 2.5, "update_actor": 1.5}
    assert list(timer.pop()) == []  # reset


def test_time_of_nested_phases_is_reported_per_parent() -> None:
    clock = FakeClock()
    timer = Timer(clock=clock)
    with timer("step"):
        with timer("old_log_prob"):
            with timer("reward"):  # scored on the driver while the workers compute
                clock.now += 0.75
            clock.now += 2.0
        with timer("adv"):
            with timer("gen"):  # ReMax's greedy baseline, twice
                clock.now += 1.0
            with timer("gen"):
                clock.now += 0.5
            clock.now += 0.25
    # Only direct children count: "step" holds its phases (4.5 s), not the reward inside old_log_prob again.
    assert timer.inner() == {"step": 4.5, "old_log_prob": 0.75, "adv": 1.5}
    assert timer.pop() == {"step": 4.5, "old_log_prob": 2.75, "reward": 0.75, "adv": 1.75, "gen": 1.5}
    assert timer.inner() == {}  # pop starts a new step
    with timer("gen"):
        clock.now += 1.0
    assert timer.inner() == {}


def test_phase_that_raises_is_still_timed() -> None:
    clock = FakeClock()
    timer = Timer(clock=clock)
    with pytest.raises(RuntimeError, match="boom"):
        with timer("reward"):
            clock.now += 3.0
            raise RuntimeError("boom")
    assert timer.pop() == {"reward": 3.0}


def test_misuse_is_reported() -> None:
    timer = Timer()
    with timer("gen"):
        with pytest.raises(ValueError, match="already open"):
            with timer("gen"):
                pass
        with pytest.raises(RuntimeError, match="still open"):
            timer.pop()
    assert set(timer.pop()) == {"gen"}


def test_real_clock_measures_something() -> None:
    timer = Timer()
    with timer("sum"):
        sum(range(10000))
    assert timer.pop()["sum"] > 0.0
