"""The run's metrics sink: console, ``metrics.jsonl`` and mlflow behind one ``log(metrics, step)``.

Every backend is opened in the constructor, so a misconfigured one (unwritable directory, a
tracking store that cannot be reached) fails before training starts, not at the first log.

Resume (``resume_step=S``, the step of the checkpoint the run continues from):
- mlflow: the run id in ``<run_dir>/tracking.json`` is reopened, so one megarl run is one mlflow run;
  steps the earlier attempt already logged are not logged twice (see ``mlflow_backend``).
- jsonl: ``metrics.jsonl`` keeps the lines with ``step <= S`` and appends from there (see ``jsonl``).

``append_only`` (``trainer.val_only`` on a run that has checkpoints): the validation line is added to
the run's metrics as they are, without truncating ``metrics.jsonl`` after ``S`` and, in mlflow, even
at a step the earlier attempts logged.
"""

from __future__ import annotations

import logging
import numbers
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from megarl.errors import ConfigError, MegarlError
from megarl.tracking.console import format_step_line
from megarl.tracking.jsonl import JsonlWriter

logger = logging.getLogger(__name__)

BACKENDS = ("console", "jsonl", "mlflow")


def _to_float(value: Any) -> Optional[float]:
    """A plain float from a number, numpy scalar or one-element tensor; None for anything else."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Number):
        return float(value)  # type: ignore[arg-type]
    if hasattr(value, "numel") and hasattr(value, "item"):  # torch tensor
        return float(value.item()) if value.numel() == 1 else None
    if hasattr(value, "item") and getattr(value, "size", None) == 1:  # numpy scalar / 1-element array
        return float(value.item())
    return None


def _print_line(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


class Tracker:
    """Logs per-step metrics to the configured backends.

    Args:
        run_dir: the run directory (created if missing); holds ``metrics.jsonl``, ``tracking.json``
            and, by default, the mlflow sqlite store ``mlflow.db``.
        backends: any of ``"console"``, ``"jsonl"``, ``"mlflow"``.
        project: mlflow experiment name.
        experiment: megarl experiment name; the mlflow run name unless ``run_name`` is given.
        mlflow_tracking_uri: mlflow store; ``None`` means ``sqlite:///<run_dir>/mlflow.db``.
        config: the experiment config (nested dict, OmegaConf or dataclass), logged as flattened params.
        resume_step: the checkpoint step a resumed run continues from; ``None`` for a fresh run.
        append_only: add to a resumed run's metrics without dropping any (module docstring).
        console_write: how console lines are written (default: print to stdout); pass
            ``Progress.write`` so lines do not break a progress bar.
        total_steps: shown as ``step k/total`` on the console.
    """

    def __init__(
        self,
        run_dir: str | Path,
        backends: Sequence[str] = BACKENDS,
        project: str = "megarl",
        experiment: str = "default",
        run_name: Optional[str] = None,
        mlflow_tracking_uri: Optional[str] = None,
        config: Any = None,
        resume_step: Optional[int] = None,
        console_write: Optional[Callable[[str], None]] = None,
        total_steps: Optional[int] = None,
        append_only: bool = False,
    ) -> None:
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ConfigError(f"tracking.backends: unknown backend(s) {unknown}; valid: {list(BACKENDS)}")
        self.run_dir = Path(run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise MegarlError(f"tracking: cannot create the run directory {self.run_dir}: {err}") from err
        self.backends = tuple(dict.fromkeys(backends))
        self.total_steps = total_steps
        self._write_console = console_write or _print_line
        self._dropped: set[str] = set()
        self._jsonl: Optional[JsonlWriter] = None
        self._mlflow: Any = None
        self._closed = False
        # mlflow first: it is the backend most likely to fail, and it changes nothing when it does
        # (the JSONL writer renames or truncates the old metrics file as it opens).
        try:
            if "mlflow" in self.backends:
                from megarl.tracking.mlflow_backend import MlflowBackend

                self._mlflow = MlflowBackend(
                    self.run_dir,
                    experiment=project,
                    run_name=run_name or experiment,
                    tracking_uri=mlflow_tracking_uri,
                    resume=resume_step is not None,
                    log_earlier_steps=append_only,
                )
            if "jsonl" in self.backends:
                self._jsonl = JsonlWriter(self.run_dir, resume_step=resume_step, keep_all=append_only)
            if config is not None:
                self.log_params(config)
        except BaseException:
            # What started is ended: the mlflow run as FAILED (not left RUNNING), the JSONL file closed.
            self.close(status="FAILED")
            raise

    @property
    def mlflow_run_id(self) -> Optional[str]:
        """The mlflow run this tracker logs to (None without the mlflow backend)."""
        return None if self._mlflow is None else self._mlflow.run_id

    def _clean(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        clean: dict[str, float] = {}
        for name, value in metrics.items():
            number = _to_float(value)
            if number is None:
                if name not in self._dropped:
                    self._dropped.add(name)
                    logger.warning("tracker: metric %r is not a number (%s); not logged", name, type(value).__name__)
                continue
            clean[str(name)] = number
        return clean

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step's metrics (numbers, numpy scalars or 1-element tensors) to every backend.

        Call once per step with everything for that step merged: the JSONL file gets one line per call.
        """
        if step < 0:
            raise ValueError(f"Tracker.log: step must be >= 0, got {step}")
        values = self._clean(metrics)
        now = time.time()
        if self._jsonl is not None:
            self._jsonl.write(step, values, timestamp=now)
        if self._mlflow is not None:
            self._mlflow.log_metrics(values, step, timestamp=now)
        if "console" in self.backends:
            self._write_console(format_step_line(step, values, self.total_steps))

    def flush(self) -> None:
        """Write what mlflow holds back (it writes steps in batches, see ``mlflow_backend``); the
        JSONL file and the console are written at once."""
        if self._mlflow is not None:
            self._mlflow.flush()

    def log_params(self, config: Any) -> None:
        """Log a config (nested mapping, OmegaConf or dataclass) as flattened params (mlflow only)."""
        if self._mlflow is None:
            return
        from megarl.tracking.mlflow_backend import flatten_config

        self._mlflow.log_params(flatten_config(config))

    def close(self, status: str = "FINISHED") -> None:
        """Close the backends; ``status`` (FINISHED, FAILED, KILLED) ends the mlflow run."""
        if self._closed:
            return
        self._closed = True
        if self._jsonl is not None:
            self._jsonl.close()
        if self._mlflow is not None:
            self._mlflow.close(status)

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("FINISHED" if exc_type is None else ("KILLED" if exc_type is KeyboardInterrupt else "FAILED"))


def tracker_from_config(
    config: Any,
    run_dir: Optional[str | Path] = None,
    resume_step: Optional[int] = None,
    console_write: Optional[Callable[[str], None]] = None,
    total_steps: Optional[int] = None,
) -> Tracker:
    """A ``Tracker`` from an experiment config (``trainer.*`` names, ``tracking.*`` backends and URI).

    ``run_dir`` defaults to ``trainer.default_local_dir``; the whole config is logged as params.
    """
    trainer, tracking = config.trainer, config.tracking
    return Tracker(
        run_dir if run_dir is not None else trainer.default_local_dir,
        backends=list(tracking.backends),
        project=trainer.project_name,
        experiment=trainer.experiment_name,
        mlflow_tracking_uri=tracking.mlflow_tracking_uri,
        config=config,
        resume_step=resume_step,
        console_write=console_write,
        total_steps=total_steps,
    )
