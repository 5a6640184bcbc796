"""Progress: ETA from the moving average of step times, phases, plain lines without a TTY."""

from __future__ import annotations

import io

import pytest

from megarl.tracking.progress import Progress, format_duration

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_with_moving_average_eta() -> None:
    clock, lines = FakeClock(), []
    progress = Progress(total_steps=10, window=2, stream=io.StringIO(), line_write=lines.append, clock=clock)
    assert not progress.bar_enabled  # a StringIO is not a terminal
    progress.start()
    clock.now = 60.0  # step 1: 60 s (startup-free, as start() was called)
    progress.step_done(1, reward=0.25)
    assert progress.eta_seconds() == 9 * 60.0
    clock.now += 10.0
    progress.step_done(2)
    clock.now += 20.0
    progress.step_done(3, reward=0.5)
    # window 2: steps 2 and 3 -> 15 s a step, 7 steps left
    assert progress.mean_step_time() == 15.0 and progress.eta_seconds() == 105.0
    assert lines == [
        "step 1/10 | 60 s/step | ETA 9:00 | reward 0.250",
        "step 2/10 | 35 s/step | ETA 4:40 | reward 0.250",
        "step 3/10 | 15 s/step | ETA 1:45 | reward 0.500",
    ]


def test_resume_start_step_and_log_every() -> None:
    clock, lines = FakeClock(), []
    progress = Progress(total_steps=6, start_step=3, enabled=False, log_every=2, line_write=lines.append, clock=clock)
    progress.start()
    for step in (4, 5, 6):
        clock.now += 2.0
        progress.step_done(step)
    assert lines == ["step 4/6 | 2 s/step | ETA 0:04", "step 6/6 | 2 s/step | ETA 0:00"]


def test_bar_on_a_terminal_shows_phase_eta_and_reward() -> None:
    clock, stream = FakeClock(), FakeTTY()
    with Progress(total_steps=4, stream=stream, clock=clock) as progress:
        assert progress.bar_enabled
        progress.start()
        with progress.phase("gen"):
            assert progress.current_phase == "gen"
            assert stream.getvalue().split("\r")[-1].startswith("gen")
            with progress.phase("reward"):
                assert progress.current_phase == "reward"
            assert progress.current_phase == "gen"
        clock.now = 30.0
        progress.step_done(1, reward=0.75)
        shown = stream.getvalue().split("\r")[-1]
        assert "1/4" in shown and "ETA 1:30" in shown and "reward 0.750" in shown
        progress.write("a console line")
    assert progress.current_phase is None


def test_disabled_on_a_terminal_and_bad_arguments() -> None:
    assert not Progress(total_steps=3, enabled=False, stream=FakeTTY()).bar_enabled
    with pytest.raises(ValueError, match="start_step"):
        Progress(total_steps=3, start_step=4)
    with pytest.raises(ValueError, match="window"):
        Progress(total_steps=3, window=0)


def test_format_duration() -> None:
    assert format_duration(59.6) == "1:00"
    assert format_duration(3723) == "1:02:03"
    assert format_duration(-5) == "0:00"


def test_a_new_estimate_of_the_last_step_moves_the_eta() -> None:
    from megarl.tracking.progress import Progress

    times = iter([0.0, 2.0, 4.0])
    progress = Progress(100, enabled=False, clock=lambda: next(times), line_write=lambda line: None)
    progress.start()
    progress.step_done(1)
    progress.step_done(2)
    assert progress.eta_seconds() == 2.0 * 98
    progress.set_total_steps(12)
    assert progress.eta_seconds() == 2.0 * 10 and progress.status_line().startswith("step 2/12")
    progress.set_total_steps(1)  # never below the steps done
    assert progress.total_steps == 2
