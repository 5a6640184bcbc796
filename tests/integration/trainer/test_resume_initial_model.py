"""A resume that cannot succeed leaves the run directory byte for byte as it was: `megarl train`
refuses, before Ray starts and before it writes config.yaml or initial_model/, a config that would
build another initial model than the run's (a tokenizer with a larger vocabulary changes the
embedding's shape; another trainer.seed other reference weights) and a damaged initial model; the
run then still resumes with its own config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.data.tokenizer import build_char_tokenizer
from test_train_e2e import read_metrics, run_train, task_dir, write_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """config.yaml, metrics.jsonl and every file of initial_model/ (links followed), by path."""
    files = [run_dir / "config.yaml", run_dir / "metrics.jsonl", *sorted((run_dir / "initial_model").rglob("*"))]
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in files if p.is_file()}


def refused(config: Path, run_dir: Path, *overrides: str) -> str:
    before = snapshot(run_dir)
    proc = run_train(config, *overrides, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "Started a local Ray instance" not in proc.stderr and "ray_cluster" not in proc.stderr
    after = snapshot(run_dir)
    assert sorted(after) == sorted(before)
    changed = [name for name in before if after[name] != before[name]]
    assert not changed, f"the refused resume rewrote {changed}"
    return proc.stderr


def test_failed_resumes_leave_the_run_untouched(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    config = write_config(tmp_path, task_dir, trainer={"save_freq": 1, "seed": 3})
    assert run_train(config).returncode == 0
    run_dir = tmp_path / "run"
    assert {"config.yaml", "metrics.jsonl", "initial_model/model.safetensors"} <= set(snapshot(run_dir))
    vocab = json.loads((run_dir / "initial_model" / "config.json").read_text())["vocab_size"]

    # A tokenizer with more characters: the embedding would have another shape.
    wider = tmp_path / "wider_tokenizer"
    wider_vocab = len(build_char_tokenizer("0123456789+= abcd", wider))
    assert wider_vocab > vocab
    err = refused(config, run_dir, f"data.tokenizer={wider}", "trainer.total_training_steps=3")
    assert "this run would build another initial model than" in err and "nothing was written" in err
    assert f"vocab_size: {vocab} there, {wider_vocab} now" in err

    # Another seed: other initial (reference) weights.
    err = refused(config, run_dir, "trainer.seed=4", "trainer.total_training_steps=3")
    assert "trainer.seed: 3 in the checkpoint's run, 4 now" in err

    # A truncated initial model: named, not rebuilt over.
    weights = run_dir / "initial_model" / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[:-64])
    err = refused(config, run_dir, "trainer.total_training_steps=3")
    assert f"initial model: {weights}: truncated: tensor" in err and f"Remove {run_dir / 'initial_model'}" in err
    weights.write_bytes(intact)

    # With its own config the run resumes from step 2 and trains step 3.
    metrics_before = read_metrics(run_dir)
    proc = run_train(config, "trainer.total_training_steps=3")
    assert proc.returncode == 0
    metrics = read_metrics(run_dir)
    assert sorted(metrics) == [1, 2, 3] and metrics[2] == metrics_before[2]
    assert weights.read_bytes() == intact
