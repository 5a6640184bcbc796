"""Tracker: a real sqlite mlflow store read back with MlflowClient, the JSONL file, resume, console."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from megarl.errors import ConfigError
from megarl.tracking.jsonl import MetricsFileError, read_metrics
from megarl.tracking.mlflow_backend import TrackingError, flatten_config, sanitize_name, truncate_param_value
from megarl.tracking.tracker import Tracker

pytestmark = pytest.mark.unit

LONG = "x" * 7000  # over mlflow's 6000-character param limit


def _jsonl_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _history(client, run_id: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a metric's history, by step."""
    points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
    return [s for s, _ in points], [v for _, v in points]


def test_mlflow_store_jsonl_and_resume_continue_one_run(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    config = {"actor": {"optim": {"lr": 1e-6}, "clip_ratio_high": 0.28}, "data": {"files": ["a", "b"]}, "note": LONG}
    lines: list[str] = []
    tracker = Tracker(
        run_dir, project="proj", experiment="exp1", config=config, console_write=lines.append, total_steps=5
    )
    run_id = tracker.mlflow_run_id
    for step in (1, 2, 3, 4):
        tracker.log({"critic/score/mean": 0.1 * step, "actor/pg_loss": -step}, step)
        tracker.log({"val-core/x/reward/mean@4": 2.0 * step}, step)  # a second call for the same step
    tracker.close()  # then the "crash": the checkpoint is at step 2, steps 3-4 are trained again

    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    run = client.get_run(run_id)
    assert run.info.run_name == "exp1" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    params = run.data.params
    assert params["actor.optim.lr"] == "1e-06" and params["actor.clip_ratio_high"] == "0.28"
    assert params["data.files"] == '["a", "b"]'
    assert len(params["note"]) == 6000 and params["note"].endswith("...[truncated]")
    steps, values = _history(client, run_id, "critic/score/mean")
    assert steps == [1, 2, 3, 4] and values == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert _history(client, run_id, "val-core/x/reward/mean_at_4")[0] == [1, 2, 3, 4]  # "@" sanitised
    assert lines[:2] == ["step 1/5 | score 0.1 | pg_loss -1", "step 1/5 | val 2"]

    resumed = Tracker(run_dir, project="proj", experiment="exp1", config=config, resume_step=2, console_write=lines.append)
    assert resumed.mlflow_run_id == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    for step in (3, 4, 5):
        resumed.log({"critic/score/mean": 1.0 * step, "actor/pg_loss": 0.0}, step)
    resumed.close()

    # mlflow: one value per step; steps 3-4 keep the first attempt's values (mlflow cannot delete values).
    steps, values = _history(client, run_id, "critic/score/mean")
    assert steps == [1, 2, 3, 4, 5] and values == pytest.approx([0.1, 0.2, 0.3, 0.4, 5.0])
    # JSONL: steps <= 2 kept, then the resumed attempt's lines; no step twice.
    records = _jsonl_lines(run_dir)
    assert [r["step"] for r in records] == [1, 1, 2, 2, 3, 4, 5]  # one line per log call
    records = read_metrics(run_dir / "metrics.jsonl")  # merged by step
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["metrics"]["critic/score/mean"] for r in records] == pytest.approx([0.1, 0.2, 3.0, 4.0, 5.0])
    assert len(client.search_runs([run.info.experiment_id])) == 1

    # The store goes away mid-run: logging goes on (JSONL keeps the step), the failure is counted.
    again = Tracker(run_dir, backends=["jsonl", "mlflow"], project="proj", experiment="exp1", resume_step=5)
    (run_dir / "mlflow.db").unlink()
    (run_dir / "mlflow.db").mkdir()
    again._mlflow._client._tracking_client.store.engine.dispose()  # drop pooled connections to the old file
    again.log({"critic/score/mean": 6.0}, 6)
    again.close()
    assert again._mlflow.failures == 1
    last = read_metrics(run_dir / "metrics.jsonl")[-1]
    assert last["step"] == 6 and last["metrics"] == {"critic/score/mean": 6.0}
    assert abs(last["time"] - time.time()) < 600


def test_mlflow_writes_steps_in_batches_of_one_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    from megarl.tracking import mlflow_backend

    monkeypatch.setattr(mlflow_backend, "WRITE_EVERY_S", 3600.0)
    run_dir = tmp_path / "run"
    tracker = Tracker(run_dir, backends=["mlflow"], project="proj", experiment="exp")
    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    calls: list[int] = []
    write = tracker._mlflow._client.log_batch
    monkeypatch.setattr(tracker._mlflow._client, "log_batch",
                        lambda run_id, metrics: calls.append(len(metrics)) or write(run_id, metrics=metrics))

    def written() -> list[int]:
        return _history(client, tracker.mlflow_run_id, "m/0")[0]

    for step in range(1, 10):  # 9 steps of 100 values: under one call's 1,000
        tracker.log({f"m/{i}": step * 1000 + i for i in range(100)}, step)
    assert written() == [] and calls == []
    tracker.log({f"m/{i}": 10_000 + i for i in range(100)}, 10)
    assert written() == list(range(1, 11)) and calls == [1000]
    assert json.loads((run_dir / "tracking.json").read_text())["mlflow_last_step"] == 10
    tracker.log({"m/0": 11.0}, 11)
    tracker.flush()  # as before a checkpoint
    assert written() == list(range(1, 12)) and calls == [1000, 1]
    _, values = _history(client, tracker.mlflow_run_id, "m/99")
    assert values == [step * 1000 + 99 for step in range(1, 11)]
    # A slow run (a step takes longer than WRITE_EVERY_S) writes every step as it comes.
    monkeypatch.setattr(mlflow_backend, "WRITE_EVERY_S", 0.0)
    tracker.log({"m/0": 12.0}, 12)
    assert written()[-1] == 12 and calls == [1000, 1, 1]
    tracker.close()


def test_unusable_mlflow_store_fails_at_construction_and_changes_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the store's directory should be")
    old_metrics = '{"step": 1, "time": 0.0, "metrics": {"a": 1.0}}\n'
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(old_metrics)
    with pytest.raises(TrackingError, match="not_a_dir.*tracking.mlflow_tracking_uri"):
        Tracker(tmp_path / "run", mlflow_tracking_uri=f"sqlite:///{blocker}/mlflow.db", console_write=lambda s: None)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == old_metrics


def test_jsonl_console_without_mlflow(tmp_path: Path) -> None:
    import numpy as np
    import torch

    lines: list[str] = []
    with Tracker(tmp_path, backends=["console", "jsonl"], console_write=lines.append) as tracker:
        assert tracker.mlflow_run_id is None
        tracker.log(
            {
                "critic/score/mean": np.float32(0.5),
                "perf/throughput": torch.tensor(1234.0),
                "actor/entropy": float("nan"),
                "note": "text is not a metric",
            },
            step=7,
        )
    (record,) = _jsonl_lines(tmp_path)
    assert record["step"] == 7 and isinstance(record["time"], float)
    assert record["metrics"] == {"critic/score/mean": 0.5, "perf/throughput": 1234.0, "actor/entropy": None}
    assert lines == ["step 7 | score 0.5 | entropy nan | tok/s 1234"]
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["metrics"]["perf/throughput"] == 1234.0
    assert not (tmp_path / "mlflow.db").exists()


def test_fresh_run_keeps_old_metrics_file_and_resume_truncates(tmp_path: Path) -> None:
    with Tracker(tmp_path, backends=["jsonl"]) as t:
        for step in (1, 2, 3):
            t.log({"a": step}, step)
    with Tracker(tmp_path, backends=["jsonl"], resume_step=1) as t:
        t.log({"a": 20}, 2)
    assert [(r["step"], r["metrics"]["a"]) for r in _jsonl_lines(tmp_path)] == [(1, 1), (2, 20)]
    with Tracker(tmp_path, backends=["jsonl"]) as t:  # not resumed: a new history
        t.log({"a": 9}, 1)
    assert [r["step"] for r in _jsonl_lines(tmp_path)] == [1]
    (old,) = [p for p in tmp_path.glob("metrics.*.jsonl")]
    assert [json.loads(x)["step"] for x in old.read_text().splitlines()] == [1, 2]


def test_read_metrics_merges_steps_and_reports_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 2, "time": 1.0, "metrics": {"a": 1}}\n'
        '{"step": 1, "time": 0.5, "metrics": {"a": 0}}\n'
        '{"step": 2, "time": 2.0, "metrics": {"b": null}}\n'
        '{"step": 3, "metr'  # cut short by a kill: ignored
    )
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["metrics"]["a"] == 1.0 and records[1]["metrics"]["b"] != records[1]["metrics"]["b"]  # NaN
    path.write_text('{"step": 1, "metrics": {}}\nnot json\n{"step": 2, "metrics": {}}\n')
    with pytest.raises(MetricsFileError, match="metrics.jsonl:2"):
        read_metrics(path)
    with pytest.raises(MetricsFileError, match="not found"):
        read_metrics(tmp_path / "missing.jsonl")


def test_bad_backend_and_step(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="wandb.*valid"):
        Tracker(tmp_path, backends=["wandb"])
    with Tracker(tmp_path, backends=["jsonl"]) as t, pytest.raises(ValueError, match="step must be >= 0"):
        t.log({"a": 1}, step=-1)


def test_names_and_params_helpers() -> None:
    assert sanitize_name("val-core/gsm8k/reward/mean@4") == "val-core/gsm8k/reward/mean_at_4"
    assert sanitize_name("/a//b/../c/") == "a/b/_/c"
    assert sanitize_name("timing_s/update actor") == "timing_s/update actor"
    assert truncate_param_value("short") == "short"
    assert len(truncate_param_value(LONG)) == 6000
    assert flatten_config({"a": {"b": None, "c": [1, 2]}, "d": True}) == {"a.b": "null", "a.c": "[1, 2]", "d": "true"}


def test_tracker_from_experiment_config(tmp_path: Path) -> None:
    from megarl.config import load_config
    from megarl.tracking.tracker import tracker_from_config

    cfg = load_config(None, [f"trainer.default_local_dir={tmp_path}/run", "tracking.backends=[jsonl]"], validate=False)
    with tracker_from_config(cfg, total_steps=3) as tracker:
        assert tracker.backends == ("jsonl",) and tracker.run_dir == tmp_path / "run"
        tracker.log({"critic/score/mean": 1.0}, 1)
    assert [r["step"] for r in _jsonl_lines(tmp_path / "run")] == [1]


def test_a_validation_only_pass_over_a_finished_run_adds_its_line_and_drops_nothing(tmp_path: Path) -> None:
    """`trainer.val_only` resuming a run's step-2 checkpoint after the run reached step 4: the
    validation is logged at step 2 in both stores and steps 3-4 stay (before, metrics.jsonl was cut
    after step 2 and mlflow skipped step 2 as already logged)."""
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    tracker = Tracker(run_dir, backends=["jsonl", "mlflow"], experiment="exp")
    run_id = tracker.mlflow_run_id
    for step in (1, 2, 3, 4):
        tracker.log({"critic/score/mean": 0.1 * step}, step)
    tracker.close()
    val = Tracker(run_dir, backends=["jsonl", "mlflow"], experiment="exp", resume_step=2, append_only=True)
    assert val.mlflow_run_id == run_id
    val.log({"val/reward_mean": 0.75}, 2)
    val.close()
    assert [(r["step"], sorted(r["metrics"])) for r in _jsonl_lines(run_dir)] == [
        (1, ["critic/score/mean"]), (2, ["critic/score/mean"]), (3, ["critic/score/mean"]),
        (4, ["critic/score/mean"]), (2, ["val/reward_mean"])]
    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    assert _history(client, run_id, "val/reward_mean") == ([2], [0.75])
    assert _history(client, run_id, "critic/score/mean")[0] == [1, 2, 3, 4]


def test_per_step_files_keep_each_step_once_after_a_resume(tmp_path: Path) -> None:
    from megarl.tracking.jsonl import keep_steps_up_to

    path = tmp_path / "memory_phases.jsonl"
    path.write_text("".join(json.dumps({"step": s, "transitions": [["gen", "rollout", "sleep"]]}) + "\n"
                            for s in (1, 2, 3, 4)) + '{"step": 5, "transi')  # the last line cut by a crash
    keep_steps_up_to(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert json.loads(path.read_text().splitlines()[0])["transitions"] == [["gen", "rollout", "sleep"]]
    keep_steps_up_to(path, 0)  # a fresh run
    assert path.read_text() == ""
    keep_steps_up_to(tmp_path / "missing.jsonl", 3)
    assert not (tmp_path / "missing.jsonl").exists()


def test_names_that_clean_to_one_mlflow_key_keep_series_of_their_own(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    tracker = Tracker(run_dir, backends=["mlflow"], experiment="exp")
    long_a, long_b = "m/" + "a" * 300 + "/x", "m/" + "a" * 300 + "/y"  # the same once cut to 250
    tracker.log({"acc/mean@4": 1.0, "acc/mean_at_4": 2.0, long_a: 3.0, long_b: 4.0}, 1)
    run_id = tracker.mlflow_run_id
    tracker.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    values = {key: value for key, value in client.get_run(run_id).data.metrics.items()}
    assert len(values) == 4 and sorted(values.values()) == [1.0, 2.0, 3.0, 4.0]
    assert values["acc/mean_at_4"] == 1.0 and all(len(key) <= 250 for key in values)


def test_a_validation_only_pass_drops_a_last_line_cut_short_before_appending(tmp_path: Path) -> None:
    """`keep_all` (a validation-only pass over a checkpoint) appends to metrics.jsonl as it is: a last
    line a crash cut short is dropped first, as a resume does (before, the new line was glued to the
    fragment and every later read or resume of the file failed)."""
    from megarl.tracking.jsonl import JsonlWriter, truncate_after_step

    path = tmp_path / "metrics.jsonl"
    complete = json.dumps({"step": 1, "time": 1.0, "metrics": {"x": 1.0}}) + "\n"
    path.write_text(complete + '{"step": 2, "time')  # cut short by a crash
    writer = JsonlWriter(tmp_path, resume_step=1, keep_all=True)
    writer.write(1, {"v": 1.0})
    writer.close()
    assert path.read_text().startswith(complete) and path.read_text().endswith("\n")
    assert [(r["step"], r["metrics"]) for r in read_metrics(path)] == [(1, {"x": 1.0, "v": 1.0})]
    assert truncate_after_step(path, 1) == 0
    assert [json.loads(line)["metrics"] for line in path.read_text().splitlines()] == [{"x": 1.0}, {"v": 1.0}]


def test_param_names_that_clean_to_one_key_get_keys_of_their_own(tmp_path: Path) -> None:
    """`a@b` and `a_at_b` both clean to `a_at_b`: before, mlflow refused the batch (a raw
    MlflowException at start-up); now the second gets a hash suffix, as metric names do, and a
    resumed run finds each value under its key as before."""
    from mlflow.tracking import MlflowClient

    config = {"a_at_b": 2, "a@b": 1}
    tracker = Tracker(tmp_path, backends=["jsonl", "mlflow"], config=config)
    run_id = tracker.mlflow_run_id
    tracker.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}")
    params = client.get_run(run_id).data.params
    assert params["a_at_b"] == "2" and sorted(params.values()) == ["1", "2"] and len(params) == 2
    (hashed,) = [key for key in params if key != "a_at_b"]
    assert hashed.startswith("a_at_b_")
    # Resumed with the names in the other order: same keys, nothing recorded as changed.
    resumed = Tracker(tmp_path, backends=["jsonl", "mlflow"], config={"a@b": 1, "a_at_b": 2}, resume_step=0)
    resumed.close()
    run = client.get_run(run_id)
    assert run.data.params == params
    assert not [tag for tag in run.data.tags if tag.startswith("resume_changed")]


def test_a_backend_failing_at_start_ends_those_already_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Logging the config fails after mlflow and the JSONL file were opened: the mlflow run ends
    FAILED (before, it stayed RUNNING) and metrics.jsonl is closed (before, left open)."""
    from mlflow.tracking import MlflowClient

    from megarl.tracking import tracker as tracker_module
    from megarl.tracking.jsonl import JsonlWriter
    from megarl.tracking.mlflow_backend import MlflowBackend

    writers: list[JsonlWriter] = []

    class RecordedWriter(JsonlWriter):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            writers.append(self)

    def refuse(self, params) -> None:
        raise TrackingError("mlflow backend: the store refused the params")

    monkeypatch.setattr(tracker_module, "JsonlWriter", RecordedWriter)
    monkeypatch.setattr(MlflowBackend, "log_params", refuse)
    with pytest.raises(TrackingError, match="refused the params"):
        Tracker(tmp_path, backends=["jsonl", "mlflow"], config={"a": 1})
    state = json.loads((tmp_path / "tracking.json").read_text())
    client = MlflowClient(tracking_uri=state["mlflow_tracking_uri"])
    assert client.get_run(state["mlflow_run_id"]).info.status == "FAILED"
    (writer,) = writers
    assert writer._file.closed


def test_a_run_directory_moved_between_attempts_continues_its_mlflow_run(tmp_path: Path) -> None:
    """The default store is the run directory's own mlflow.db: after the directory is renamed (or
    mounted elsewhere) the resumed run finds its mlflow run there (before, the stored absolute URI
    differed and a new mlflow run split the history)."""
    import os

    from mlflow.tracking import MlflowClient

    first = tmp_path / "run"
    tracker = Tracker(first, backends=["jsonl", "mlflow"])
    run_id = tracker.mlflow_run_id
    for step in (1, 2, 3):
        tracker.log({"x": float(step)}, step)
    tracker.close()
    moved = tmp_path / "moved"
    os.rename(first, moved)
    resumed = Tracker(moved, backends=["jsonl", "mlflow"], resume_step=3)
    assert resumed.mlflow_run_id == run_id
    for step in (4, 5):
        resumed.log({"x": float(step)}, step)
    resumed.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{(moved / 'mlflow.db').resolve()}")
    assert _history(client, run_id, "x") == ([1, 2, 3, 4, 5], [1.0, 2.0, 3.0, 4.0, 5.0])
    assert len(client.search_runs([client.get_run(run_id).info.experiment_id])) == 1
    assert json.loads((moved / "tracking.json").read_text())["mlflow_tracking_uri"].endswith("/moved/mlflow.db")


def test_a_resumed_run_keeps_the_metric_keys_of_the_earlier_attempt(tmp_path: Path) -> None:
    """The first attempt logs only `v/x@4` (key `v/x_at_4`); the resumed one also logs `v/x_at_4`,
    first: each series must still hold one metric's values (before, the plain key went to the name
    seen first in the attempt, so `v/x_at_4` mixed both after the resume)."""
    from mlflow.tracking import MlflowClient

    tracker = Tracker(tmp_path, backends=["mlflow"])
    run_id = tracker.mlflow_run_id
    for step in (1, 2):
        tracker.log({"v/x@4": 1.0}, step)
    tracker.flush()
    tracker.close("FAILED")
    resumed = Tracker(tmp_path, backends=["mlflow"], resume_step=2)
    for step in (3, 4):
        resumed.log({"v/x_at_4": 9.0, "v/x@4": 1.0}, step)
    resumed.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}")
    assert _history(client, run_id, "v/x_at_4") == ([1, 2, 3, 4], [1.0, 1.0, 1.0, 1.0])
    (other,) = [key for key in client.get_run(run_id).data.metrics if key != "v/x_at_4"]
    assert _history(client, run_id, other) == ([3, 4], [9.0, 9.0])


def test_resuming_into_a_deleted_mlflow_run_says_so(tmp_path: Path) -> None:
    """Before, the message blamed the store ("cannot use tracking store ... a writable store")."""
    from mlflow.tracking import MlflowClient

    tracker = Tracker(tmp_path, backends=["mlflow"])
    tracker.log({"x": 1.0}, 1)
    tracker.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}")
    client.delete_run(tracker.mlflow_run_id)
    with pytest.raises(TrackingError) as info:
        Tracker(tmp_path, backends=["mlflow"], resume_step=1)
    message = str(info.value)
    assert f"mlflow run {tracker.mlflow_run_id}, which was deleted" in message
    assert "mlflow runs restore" in message and "tracking.json to start a new mlflow run" in message
    assert "writable store" not in message
