"""The run's metrics file: ``metrics.jsonl``, one JSON object per logged step.

Each line is ``{"step": int, "time": unix seconds, "metrics": {name: float | null}}``. Non-finite
values (NaN, inf) are written as ``null`` so that every line is strict JSON.

Resume: a run restarted from the checkpoint of step S keeps the lines with ``step <= S`` and drops
the rest (the steps after S are trained again and logged anew), so no step appears twice.
A fresh (not resumed) run that finds an old ``metrics.jsonl`` renames it to
``metrics.<UTC time>.jsonl`` instead of overwriting it.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import IO, Any, Optional, Union

from megarl.errors import MegarlError

METRICS_FILE = "metrics.jsonl"


class MetricsFileError(MegarlError, ValueError):
    """``metrics.jsonl`` is missing or has a malformed line (the message names file and line)."""


def _finite_or_none(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None


class JsonlWriter:
    """Appends one line per ``write`` call to ``<run_dir>/metrics.jsonl`` and flushes it."""

    def __init__(self, run_dir: Union[str, Path], resume_step: Optional[int] = None, keep_all: bool = False) -> None:
        """`keep_all`: a resumed run appends to the file as it is (a validation-only pass over it)."""
        self.path = Path(run_dir) / METRICS_FILE
        if resume_step is not None:
            if self.path.exists() and not keep_all:
                truncate_after_step(self.path, resume_step)
            elif self.path.exists():
                _drop_cut_last_line(self.path)
        elif self.path.exists() and self.path.stat().st_size > 0:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            self.path.rename(self.path.with_name(f"metrics.{stamp}.jsonl"))
        try:
            self._file: IO[str] = open(self.path, "a", encoding="utf-8")
        except OSError as err:
            raise MegarlError(f"jsonl tracking: cannot open {self.path} for writing: {err}") from err

    def write(self, step: int, metrics: dict[str, float], timestamp: Optional[float] = None) -> None:
        record = {
            "step": int(step),
            "time": time.time() if timestamp is None else timestamp,
            "metrics": {k: _finite_or_none(v) for k, v in metrics.items()},
        }
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _parse_lines(path: Path) -> list[dict[str, Any]]:
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record["step"])
                metrics = record["metrics"]
                if not isinstance(metrics, dict):
                    raise TypeError("'metrics' is not an object")
            except (ValueError, KeyError, TypeError) as err:
                if not line.endswith("\n"):
                    continue  # a last line cut short by a crash: skip it
                raise MetricsFileError(
                    f"{path}:{lineno}: not a metrics record ({err}); expected "
                    '{"step": int, "time": float, "metrics": {name: number}}'
                ) from err
            records.append({"step": step, "time": record.get("time"), "metrics": metrics, "line": line})
    return records


def _drop_cut_last_line(path: Path) -> None:
    """Remove a last line that a crash cut short (no final newline), as `truncate_after_step`
    does, so that the next line appended starts a line of its own."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        os.truncate(path, end)


def truncate_after_step(path: Union[str, Path], step: int) -> int:
    """Rewrite ``path`` keeping only records with ``step <= step`` (atomically). Returns lines dropped."""
    path = Path(path)
    records = _parse_lines(path)
    kept = [r["line"] for r in records if r["step"] <= step]
    _replace_lines(path, kept)
    return len(records) - len(kept)


def _replace_lines(path: Path, lines: list[str]) -> None:
    """Write `lines` (each ended by a newline) in place of `path`'s content, atomically."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line in lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def keep_steps_up_to(path: Union[str, Path], step: int) -> None:
    """Rewrite a JSONL file of ``{"step": ...}`` lines (any other fields) keeping those with
    ``step <= step`` (atomically); a missing file stays missing. A resumed run's per-step files
    then hold each step once."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    kept = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash
    _replace_lines(path, kept)


def read_metrics(path: Union[str, Path]) -> list[dict[str, Any]]:
    """Records of a metrics file, one per step, sorted by step.

    Lines with the same step are merged (later values win); ``null`` becomes NaN. Each record is
    ``{"step": int, "time": float | None, "metrics": {name: float}}``.
    """
    path = Path(path)
    if not path.is_file():
        raise MetricsFileError(f"metrics file not found: {path} (written by the jsonl tracking backend)")
    merged: dict[int, dict[str, Any]] = {}
    for r in _parse_lines(path):
        entry = merged.setdefault(r["step"], {"step": r["step"], "time": r["time"], "metrics": {}})
        if r["time"] is not None:
            entry["time"] = r["time"]
        for name, value in r["metrics"].items():
            entry["metrics"][name] = math.nan if value is None else float(value)
    return [merged[s] for s in sorted(merged)]
