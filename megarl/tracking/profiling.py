"""Torch profiler traces of chosen training steps: verl's / NeMo-RL's ``trainer.profile_steps``.

Every worker process owns one `StepProfiler`; the driver tells each worker which step it is in.
For a step listed in ``steps`` the worker records CPU activity (and CUDA kernels when CUDA is
available) and writes a Chrome trace (open it in ``chrome://tracing`` or https://ui.perfetto.dev):

    <out_dir>/step_<step>/<role>_rank<rank>.json

so that all workers' traces of one step sit in one folder. Timestamps in the trace are
microseconds. Shapes are recorded; Python stacks only with ``with_stack=True`` (they make traces
several times larger). Steps not listed cost nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

_SAFE_ROLE = re.compile(r"^[A-Za-z0-9_.-]+$")


def trace_path(out_dir: str | Path, step: int, role: str, rank: int) -> Path:
    """Where the trace of `step` for worker (`role`, `rank`) goes."""
    return Path(out_dir) / f"step_{step}" / f"{role}_rank{rank}.json"


class StepProfiler:
    """Profiles the steps in `steps` of one worker (`role`, `rank`); see the module docstring."""

    def __init__(
        self, steps: Iterable[int], out_dir: str | Path, role: str, rank: int, *, with_stack: bool = False
    ) -> None:
        steps = list(steps)
        bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or s < 0]
        if bad:
            raise ValueError(f"profile steps must be integers >= 0, got {bad} in {steps}")
        if not _SAFE_ROLE.match(role):
            raise ValueError(f"profiler role {role!r} must be a file-name part (letters, digits, '_', '-', '.')")
        self.steps = frozenset(steps)
        self.out_dir = Path(out_dir)
        self.role = role
        self.rank = int(rank)
        self.with_stack = with_stack
        self._profiler: Optional[profile] = None
        self._step: Optional[int] = None

    @property
    def active_step(self) -> Optional[int]:
        """The step being profiled now, or None."""
        return self._step

    def start(self, step: int) -> bool:
        """Start profiling when `step` is listed; returns whether it started.

        Raises RuntimeError when a step is already being profiled (`stop` was not called).
        """
        if self._step is not None:
            raise RuntimeError(
                f"StepProfiler({self.role}, rank {self.rank}): start({step}) while step {self._step} "
                "is still being profiled; call stop() first"
            )
        if step not in self.steps:
            return False
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities, record_shapes=True, with_stack=self.with_stack)
        self._profiler.start()
        self._step = step
        return True

    def stop(self) -> Optional[Path]:
        """Stop profiling and write the Chrome trace; returns its path, or None when not profiling.

        The trace is exported to a temporary name in the same folder and renamed, so a reader never
        sees a partial file.
        """
        if self._profiler is None or self._step is None:
            return None
        profiler, step = self._profiler, self._step
        self._profiler, self._step = None, None
        profiler.stop()
        path = trace_path(self.out_dir, step, self.role, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.json")
        try:
            profiler.export_chrome_trace(str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @contextmanager
    def profiling(self, step: int) -> Iterator[StepProfiler]:
        """Profile the body when `step` is listed; the trace is written on exit, also after an error."""
        self.start(step)
        try:
            yield self
        finally:
            self.stop()
