"""mlflow backend of the tracker: one mlflow run per megarl run, continued across resumes.

Uses ``MlflowClient`` with an explicit tracking URI (no global ``mlflow.set_tracking_uri``), so
several trackers in one process do not interfere. The default store is a sqlite file under the run
directory; any URI (a server, databricks, ...) can be configured. Steps are written in batches
(`MlflowBackend.log_metrics`); ``flush`` (before each checkpoint) and ``close`` write the rest.

Resume: the run id is kept in ``<run_dir>/tracking.json``; a resumed megarl run reopens that mlflow
run (status back to RUNNING) when the tracking URI is the same (with the default store: the store in
the run directory, wherever that directory is now). The mlflow key of each metric and param name
(names that clean to one key get a hash suffix) is kept there too, so a resumed run writes each name
to the key it had before. mlflow cannot delete logged metric values, so steps that the first attempt
already logged (after the checkpoint it resumes from) are not logged again: each step keeps one value
per metric, the one of the first attempt. The JSONL file holds the values of the attempt that
continued (see ``megarl.tracking.jsonl``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from megarl.errors import MegarlError

logger = logging.getLogger(__name__)

TRACKING_STATE_FILE = "tracking.json"
# mlflow's limits (mlflow.utils.validation): param values, key lengths, entities per log_batch call.
MAX_PARAM_VALUE_LENGTH = 6000
MAX_KEY_LENGTH = 250
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
WRITE_EVERY_S = 10.0  # the longest a logged step waits to be written (a slow run writes every step)
_TRUNCATION_MARK = "...[truncated]"
_INVALID_NAME_CHARS = re.compile(r"[^/\w.\- ]")  # mlflow allows these (colon too, but not on Windows)


class TrackingError(MegarlError, RuntimeError):
    """A tracking backend cannot be used (the message names the backend and the store)."""


def default_tracking_uri(run_dir: str | Path) -> str:
    """``sqlite:///<absolute run_dir>/mlflow.db``: the store used when none is configured."""
    return "sqlite:///" + str((Path(run_dir) / "mlflow.db").resolve())


def sanitize_name(name: str) -> str:
    """A metric/param name mlflow accepts, as close to ``name`` as possible.

    ``@`` becomes ``_at_`` (``mean@4`` -> ``mean_at_4``); other characters than letters, digits,
    ``_ - . / space`` become ``_``; empty or dot-only path
    segments (``a//b``, ``./x``, a leading or trailing ``/``) are removed or replaced, because
    mlflow refuses names that change under path normalisation. Cut to 250 characters.
    """
    cleaned = _INVALID_NAME_CHARS.sub("_", name.replace("@", "_at_"))
    segments = [s if s.strip(".") else "_" for s in cleaned.split("/") if s != ""]
    return ("/".join(segments) or "_")[:MAX_KEY_LENGTH]


def truncate_param_value(value: str) -> str:
    """``value`` cut to mlflow's 6000-character limit, marked with ``...[truncated]`` when cut."""
    if len(value) <= MAX_PARAM_VALUE_LENGTH:
        return value
    return value[: MAX_PARAM_VALUE_LENGTH - len(_TRUNCATION_MARK)] + _TRUNCATION_MARK


class _Keys:
    """mlflow keys of one kind of names (metrics or params): `sanitize_name`, made distinct with a
    hash suffix when two names clean (or cut) to one key; the first name seen keeps the plain key.
    `by_name` is saved in ``tracking.json`` so that a resumed run maps every name as before."""

    def __init__(self, kind: str, saved: Any = None) -> None:
        self.kind = kind
        self.by_name: dict[str, str] = (
            {str(n): str(k) for n, k in saved.items()} if isinstance(saved, Mapping) else {}
        )
        self._taken = set(self.by_name.values())
        self.unsaved = False  # names added since the last save

    def __call__(self, name: str) -> str:
        key = self.by_name.get(name)
        if key is None:
            key = sanitize_name(name)
            collided = key in self._taken
            if collided:  # two names that clean (or cut) to one would share a key
                digest = hashlib.sha1(name.encode()).hexdigest()[:8]
                key = f"{key[:MAX_KEY_LENGTH - 9]}_{digest}"
            if collided or (key != name and self.kind == "metric"):
                logger.warning("mlflow: %s name %r logged as %r", self.kind, name, key)
            self.by_name[name] = key
            self._taken.add(key)
            self.unsaved = True
        return key


def _load_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / TRACKING_STATE_FILE
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise TrackingError(f"{path} is not valid JSON ({err}); delete it to start a new mlflow run") from err


def _save_state(run_dir: Path, state: dict[str, Any]) -> None:
    path = run_dir / TRACKING_STATE_FILE
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=2), encoding="utf-8")
    os.replace(tmp, path)


class MlflowBackend:
    """Logs metrics and params of one megarl run to one mlflow run."""

    def __init__(
        self,
        run_dir: str | Path,
        experiment: str,
        run_name: str,
        tracking_uri: Optional[str] = None,
        resume: bool = False,
        log_earlier_steps: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self._default_store = not tracking_uri
        self.tracking_uri = tracking_uri or default_tracking_uri(self.run_dir)
        self.failures = 0  # writes that raised after a successful start
        self._pending: list[Any] = []  # mlflow Metric values not written yet (see log_metrics)
        self._last_write = time.monotonic()
        state = _load_state(self.run_dir)
        # mlflow 3 sends usage telemetry over the network unless told not to; a training run logging
        # to its own store should not phone home (offline clusters would also pay retry timeouts).
        # An explicit MLFLOW_DISABLE_TELEMETRY=false from the user still wins.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        try:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
            self.run_id, self.resumed = self._open_run(state, experiment, run_name, resume)
        except TrackingError:
            raise
        except Exception as err:  # mlflow raises many types (MlflowException, sqlalchemy, OSError)
            raise TrackingError(
                f"mlflow backend: cannot use tracking store {self.tracking_uri!r} "
                f"(experiment {experiment!r}): {type(err).__name__}: {err}. Set tracking.mlflow_tracking_uri "
                "to a writable store, or remove 'mlflow' from tracking.backends."
            ) from err
        # Steps at or below this were logged by an earlier attempt of this run (see module docstring);
        # fixed for this attempt, which may log one step in several calls.
        self._earlier_attempt_up_to: int = int(state.get("mlflow_last_step", -1)) if self.resumed else -1
        self._metric_keys = _Keys("metric", state.get("mlflow_metric_keys") if self.resumed else None)
        self._param_keys = _Keys("param", state.get("mlflow_param_keys") if self.resumed else None)
        self._state = {
            "mlflow_tracking_uri": self.tracking_uri,
            # True: the store is the run directory's own mlflow.db, found there on resume even after
            # the directory was moved (its URI, an absolute path, then changed).
            "mlflow_default_store": self._default_store,
            "mlflow_experiment": experiment,
            "mlflow_run_id": self.run_id,
            "mlflow_last_step": self._earlier_attempt_up_to,
        }
        try:
            self._save_state()
        except BaseException:
            self.close("FAILED")
            raise
        if log_earlier_steps:  # a validation-only pass adds its line at a step logged before
            self._earlier_attempt_up_to = -1

    def _save_state(self) -> None:
        """Write ``tracking.json``: the run, the last step written and the name-to-key maps."""
        self._state["mlflow_metric_keys"] = self._metric_keys.by_name
        self._state["mlflow_param_keys"] = self._param_keys.by_name
        _save_state(self.run_dir, self._state)
        self._metric_keys.unsaved = self._param_keys.unsaved = False

    def _same_store(self, state: dict[str, Any]) -> bool:
        """True when the store of `state` (an earlier attempt's) is the one configured now: the same
        URI, or the run directory's default store both times (the directory may have moved since)."""
        if state.get("mlflow_tracking_uri") == self.tracking_uri:
            return True
        return bool(state.get("mlflow_default_store")) and self._default_store

    def _open_run(self, state: dict[str, Any], experiment: str, run_name: str, resume: bool) -> tuple[str, bool]:
        client = self._client
        if resume and state.get("mlflow_run_id"):
            if not self._same_store(state):
                logger.warning(
                    "mlflow: the run was tracked at %s before, now at %s: starting a new mlflow run",
                    state.get("mlflow_tracking_uri"),
                    self.tracking_uri,
                )
            else:
                run_id = state["mlflow_run_id"]
                state_file = self.run_dir / TRACKING_STATE_FILE
                try:
                    run = client.get_run(run_id)
                except Exception as err:
                    raise TrackingError(
                        f"mlflow backend: {state_file} names mlflow run {run_id}, which "
                        f"is not in {self.tracking_uri!r} ({err}). Delete that file to start a new mlflow run."
                    ) from err
                if run.info.lifecycle_stage == "deleted":
                    raise TrackingError(
                        f"mlflow backend: {state_file} names mlflow run {run_id}, which was deleted in "
                        f"{self.tracking_uri!r}. Restore it to continue it (`mlflow runs restore --run-id {run_id}` "
                        f"with MLFLOW_TRACKING_URI={self.tracking_uri}, or MlflowClient.restore_run), or delete "
                        f"{state_file} to start a new mlflow run."
                    )
                client.update_run(run_id, status="RUNNING")
                return run_id, True
        exp = client.get_experiment_by_name(experiment)
        if exp is not None:
            experiment_id = exp.experiment_id
        else:
            # With the default store, keep artifacts next to it (mlflow's default is ./mlruns under the cwd).
            location = (self.run_dir / "mlartifacts").resolve().as_uri() if self._default_store else None
            experiment_id = client.create_experiment(experiment, artifact_location=location)
        run = client.create_run(experiment_id, run_name=run_name, tags={"megarl.run_dir": str(self.run_dir.resolve())})
        return run.info.run_id, False

    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp: float) -> None:
        """Log ``metrics`` at ``step`` (skipped when an earlier attempt already logged this step).

        Steps are written in batches: when a call's worth of values (1,000) has gathered, or
        ``WRITE_EVERY_S`` after the last write, and on ``flush``/``close``. mlflow's SQL store
        spends most of a write on per-call work (it updates each metric's latest value once a
        call), so a batch of five quickstart steps costs about what two written one by one do."""
        if step <= self._earlier_attempt_up_to:
            return
        from mlflow.entities import Metric

        ms = int(timestamp * 1000)
        self._pending.extend(Metric(self._metric_keys(k), float(v), ms, int(step)) for k, v in metrics.items())
        if len(self._pending) >= MAX_METRICS_PER_BATCH or time.monotonic() - self._last_write >= WRITE_EVERY_S:
            self.flush()

    def flush(self) -> None:
        """Write the steps gathered so far."""
        pending, self._pending = self._pending, []
        self._last_write = time.monotonic()
        if not pending:
            return
        try:
            if self._metric_keys.unsaved:  # the keys before the values: a resume must map names as they were
                self._save_state()
            for i in range(0, len(pending), MAX_METRICS_PER_BATCH):
                self._client.log_batch(self.run_id, metrics=pending[i : i + MAX_METRICS_PER_BATCH])
        except Exception as err:
            # The store worked at start (checked in __init__); a later outage (a remote server
            # restarting) must not kill a long training run. metrics.jsonl still has every step.
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                steps = sorted({m.step for m in pending})
                logger.error("mlflow: logging steps %d-%d to %s failed (%d failures so far): %s",
                             steps[0], steps[-1], self.tracking_uri, self.failures, err)
            return
        last = max(m.step for m in pending)
        if last > self._state["mlflow_last_step"]:
            self._state["mlflow_last_step"] = int(last)
            self._save_state()

    def log_params(self, params: Mapping[str, str]) -> None:
        """Log string params (names sanitised, values truncated to mlflow's limits).

        Names that clean to one key get keys of their own (a hash suffix), as metric names do.
        mlflow refuses to change a logged param; on resume, params whose value changed are recorded
        as tags ``resume_changed.<name>`` with the new value instead (with a warning).
        """
        from mlflow.entities import Param, RunTag

        try:
            existing = self._client.get_run(self.run_id).data.params
            new_params: list[Param] = []
            changed: list[RunTag] = []
            for key, value in params.items():
                name, text = self._param_keys(key), truncate_param_value(value)
                if name not in existing:
                    new_params.append(Param(name, text))
                elif existing[name] != text:
                    changed.append(RunTag(sanitize_name("resume_changed." + name), text))
            if changed:
                logger.warning("mlflow: params changed since the run started: %s", [t.key for t in changed])
            if self._param_keys.unsaved:
                self._save_state()
            for i in range(0, len(new_params), MAX_PARAMS_PER_BATCH):
                self._client.log_batch(self.run_id, params=new_params[i : i + MAX_PARAMS_PER_BATCH])
            for i in range(0, len(changed), MAX_PARAMS_PER_BATCH):
                self._client.log_batch(self.run_id, tags=changed[i : i + MAX_PARAMS_PER_BATCH])
        except Exception as err:
            raise TrackingError(
                f"mlflow backend: cannot log the config as params of run {self.run_id} in {self.tracking_uri!r}: "
                f"{type(err).__name__}: {err}"
            ) from err

    def close(self, status: str = "FINISHED") -> None:
        """Write what is gathered, then end the mlflow run with ``status``; a store that went away
        is reported, not raised."""
        self.flush()
        try:
            self._client.set_terminated(self.run_id, status=status, end_time=int(time.time() * 1000))
        except Exception as err:
            logger.error("mlflow: could not mark run %s %s in %s: %s", self.run_id, status, self.tracking_uri, err)


def flatten_config(config: Any, prefix: str = "") -> dict[str, str]:
    """``{"a.b.c": "value"}`` from a nested dict / OmegaConf config / dataclass.

    Lists and other leaves become their JSON (or ``str``) text; ``None`` becomes ``"null"``.
    """
    if hasattr(config, "__dataclass_fields__"):
        import dataclasses

        config = dataclasses.asdict(config)
    elif type(config).__name__ in ("DictConfig", "ListConfig"):
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(config, resolve=True)
    flat: dict[str, str] = {}
    if isinstance(config, Mapping):
        for key, value in config.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, Mapping) or hasattr(value, "__dataclass_fields__") or type(value).__name__ == "DictConfig":
                flat.update(flatten_config(value, name))
            else:
                flat[name] = _leaf_text(value)
    else:
        flat[prefix or "value"] = _leaf_text(config)
    return flat


def _leaf_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple, bool, int, float, str)):
        return value if isinstance(value, str) else json.dumps(value, default=str)
    return str(value)
