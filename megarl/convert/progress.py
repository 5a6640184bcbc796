"""Progress of a conversion: a tqdm bar on a terminal, a few plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    """Counts tensors and bytes done out of a known total."""

    def __init__(self, what: str, total_bytes: int, total_items: int, enabled: bool = True,
                 stream: TextIO | None = None, unit: str = "tensors") -> None:
        self.what, self.total_bytes, self.total_items, self.unit = what, total_bytes, total_items, unit
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.done_bytes = self.done_items = 0
        self.start = time.perf_counter()
        self._next_line = 0.0
        self._bar: Any = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=what, file=self.stream)

    def update(self, nbytes: int, items: int = 1) -> None:
        self.done_bytes += nbytes
        self.done_items += items
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(nbytes)
            self._bar.set_postfix_str(f"{self.done_items}/{self.total_items} {self.unit}", refresh=False)
            return
        fraction = self.done_bytes / max(self.total_bytes, 1)
        if fraction >= self._next_line or self.done_items == self.total_items:
            self._next_line = fraction + 0.1
            print(f"{self.what}: {self.done_items}/{self.total_items} {self.unit}, "
                  f"{self.done_bytes / 2**20:.1f}/{self.total_bytes / 2**20:.1f} MiB "
                  f"({time.perf_counter() - self.start:.1f} s)", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
