"""Wall-clock durations of the named phases of one training step."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Timer:
    """Collects phase durations (seconds) for the current step.

    ``with timer("gen"): ...`` adds the elapsed time to phase ``gen``. Phases may nest (the outer
    phase includes the inner one, e.g. ``step`` around everything) and may repeat within a step
    (durations add up, e.g. DAPO generating several times to fill a batch). ``pop()`` returns the
    step's durations in the order phases were first entered and starts a new step. ``inner()`` gives,
    per phase of the step so far, the time of the phases nested directly in it (the reward scored while the workers
    compute the old log-probs, ReMax's greedy generation inside the advantage phase): the phase's
    time less that is its own, so that summed phases count every second once.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._durations: dict[str, float] = {}
        self._inner: dict[str, float] = {}
        self._open: list[str] = []

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if phase in self._open:
            raise ValueError(f"Timer: phase '{phase}' is already open (open phases: {self._open})")
        parent = self._open[-1] if self._open else None
        self._open.append(phase)
        self._durations.setdefault(phase, 0.0)  # record entry order even if the body raises
        start = self._clock()
        try:
            yield
        finally:
            elapsed = self._clock() - start
            self._durations[phase] += elapsed
            if parent is not None:
                self._inner[parent] = self._inner.get(parent, 0.0) + elapsed
            self._open.remove(phase)

    @property
    def open_phases(self) -> list[str]:
        """Phases currently running, outermost first."""
        return list(self._open)

    def pop(self) -> dict[str, float]:
        """The durations collected since the last ``pop()`` (seconds), then reset.

        Raises ``RuntimeError`` while a phase is still open: its time would be lost.
        """
        if self._open:
            raise RuntimeError(f"Timer.pop() while phases are still open: {self._open}")
        durations, self._durations, self._inner = self._durations, {}, {}
        return durations

    def inner(self) -> dict[str, float]:
        """Since the last ``pop()``: phase -> seconds of the phases nested directly in it (only phases
        that had any); read it before ``pop()``, which starts a new step."""
        return dict(self._inner)
