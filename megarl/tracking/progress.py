"""Progress display of a training run: step/total, current phase, ETA and last reward.

On a terminal it is a tqdm bar whose description is the running phase (``gen``, ``reward``,
``old_log_prob``, ``ref``, ``values``, ``adv``, ``update_critic``, ``update_actor``, ``val``, ``save``).
Elsewhere (logs redirected to a file, CI) or with ``enabled=False`` there is no bar; instead one plain
line per step (every ``log_every`` steps) gives step, step time, ETA and reward.

The ETA is the moving average of the last ``window`` step times times the steps left; it ignores
the time before the first step (start-up, validation before training).
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any, Optional


def format_duration(seconds: float) -> str:
    """``1:02:03`` (h:mm:ss), or ``2:03`` under an hour."""
    total = int(round(max(seconds, 0.0)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Shows where a run is. Call ``start()`` when the first step begins and ``step_done`` after each.

    Args:
        total_steps: the last step number of the run.
        start_step: the step already completed (the resume step; 0 for a fresh run).
        enabled: ``False`` never draws a bar (plain lines instead).
        window: number of recent step times the ETA averages.
        stream: where the bar goes (default stderr); a bar is drawn only if it is a TTY.
        line_write: how plain lines are written when there is no bar (default: print to stdout).
        log_every: write a plain line every this many steps (and at the last step).
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        window: int = 10,
        stream: Optional[IO[str]] = None,
        line_write: Optional[Callable[[str], None]] = None,
        log_every: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total_steps < 1 or not 0 <= start_step <= total_steps:
            raise ValueError(
                f"Progress: need total_steps >= 1 and 0 <= start_step <= total_steps, got {total_steps}, {start_step}"
            )
        if window < 1 or log_every < 1:
            raise ValueError(f"Progress: window and log_every must be >= 1, got {window}, {log_every}")
        self.total_steps = total_steps
        self.step = start_step
        self._clock = clock
        self._durations: collections.deque[float] = collections.deque(maxlen=window)
        self._last_time: Optional[float] = None
        self._phases: list[str] = []
        self.last_reward: Optional[float] = None
        self._log_every = log_every
        self._line_write = line_write or (lambda line: print(line, file=sys.stdout, flush=True))
        stream = sys.stderr if stream is None else stream
        is_tty = bool(getattr(stream, "isatty", lambda: False)())
        self._bar: Any = None
        if enabled and is_tty:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                file=stream,
                unit="step",
                dynamic_ncols=True,
                bar_format="{desc:<14}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
            )

    @property
    def bar_enabled(self) -> bool:
        return self._bar is not None

    @property
    def current_phase(self) -> Optional[str]:
        return self._phases[-1] if self._phases else None

    def start(self) -> None:
        """Mark the beginning of the first timed step (excludes set-up time from the ETA)."""
        self._last_time = self._clock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Show ``name`` as the running phase while the body runs (phases may nest)."""
        self._phases.append(name)
        self._refresh()
        try:
            yield
        finally:
            self._phases.pop()
            self._refresh()

    def set_total_steps(self, total_steps: int) -> None:
        """A new estimate of the run's last step (a run that ends with its data, whose steps take a
        varying number of batches: DAPO's dynamic sampling)."""
        self.total_steps = max(int(total_steps), self.step, 1)
        if self._bar is not None:
            self._bar.total = self.total_steps
            self._bar.refresh()

    def mean_step_time(self) -> Optional[float]:
        """Average of the last ``window`` step times in seconds (None before the first step)."""
        return sum(self._durations) / len(self._durations) if self._durations else None

    def eta_seconds(self) -> Optional[float]:
        """Estimated seconds until ``total_steps``; None before the first step finished."""
        mean = self.mean_step_time()
        return None if mean is None else mean * (self.total_steps - self.step)

    def step_done(self, step: int, reward: Optional[float] = None) -> None:
        """Record that ``step`` finished (its time is measured since the previous call or ``start``)."""
        now = self._clock()
        if self._last_time is not None:
            self._durations.append(now - self._last_time)
        self._last_time = now
        advanced = step - self.step
        self.step = step
        if reward is not None:
            self.last_reward = float(reward)
        if self._bar is not None:
            self._bar.update(max(advanced, 0))
            self._refresh()
        elif step % self._log_every == 0 or step == self.total_steps:
            self._line_write(self.status_line())

    def status_line(self) -> str:
        """``step 5/100 | 1.23 s/step | ETA 1:57 | reward 0.500``."""
        parts = [f"step {self.step}/{self.total_steps}"]
        mean = self.mean_step_time()
        if mean is not None:
            parts.append(f"{mean:.3g} s/step")
            parts.append(f"ETA {format_duration(self.eta_seconds() or 0.0)}")
        if self.last_reward is not None:
            parts.append(f"reward {self.last_reward:.3f}")
        return " | ".join(parts)

    def _refresh(self) -> None:
        if self._bar is None:
            return
        self._bar.set_description_str(self.current_phase or "", refresh=False)
        postfix = []
        eta = self.eta_seconds()
        if eta is not None:
            postfix.append(f"ETA {format_duration(eta)}")
        if self.last_reward is not None:
            postfix.append(f"reward {self.last_reward:.3f}")
        self._bar.set_postfix_str(", ".join(postfix), refresh=False)
        self._bar.refresh()

    def write(self, line: str) -> None:
        """Print a line without breaking the bar (use as the tracker's console writer)."""
        if self._bar is not None:
            self._bar.write(line)
        else:
            self._line_write(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
