"""A run directory that holds a trained run is protected: `megarl train` verifies the checkpoint it
would resume from and refuses, before Ray starts and before it writes anything, a damaged latest
checkpoint (naming the file and the earlier complete one), a changed model, a checkpoint past the
last step, and `trainer.resume_mode=disable`; with `trainer.resume_fallback=true` it resumes from the earlier one."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from test_train_e2e import read_metrics, run_train, task_dir, write_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of the run except the checkpoints' (whose damage is the test's own)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and "checkpoints" not in p.parts and "mlflow" not in p.name}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, task_dir: Path) -> tuple[Path, Path]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("guards")
    config = write_config(tmp, task_dir, trainer={"save_freq": 1, "max_ckpt_to_keep": 3})
    assert run_train(config).returncode == 0
    return config, tmp / "run"


def _refused(config: Path, run_dir: Path, *overrides: str) -> str:
    before = _snapshot(run_dir)
    start = time.perf_counter()
    proc = run_train(config, *overrides, timeout=300)
    seconds = time.perf_counter() - start
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "Started a local Ray instance" not in proc.stderr and "ray_cluster" not in proc.stderr
    assert _snapshot(run_dir) == before, "the refused run wrote into the run directory"
    print(f"refused in {seconds:.1f} s")
    return proc.stderr


def test_refusals_before_ray_and_fallback(trained: tuple[Path, Path]) -> None:
    config, run_dir = trained
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "2"

    # A different model for the same run directory: refused, initial_model/ and config.yaml kept.
    err = _refused(config, run_dir, "model.hf_config.num_hidden_layers=3", "trainer.total_training_steps=3")
    assert "this run's model differs" in err and "model.hf_config.num_hidden_layers: 2 in the checkpoint's run, 3 now" in err

    # Fewer steps than the checkpoint holds: refused (nothing to train), not a traceback.
    err = _refused(config, run_dir, "trainer.total_training_steps=1")
    assert f"{ckpts / 'global_step_2'}: the checkpoint to resume from is at step 2, past the run's last step 1" in err

    # A new run in a directory holding one: refused, metrics.jsonl kept.
    err = _refused(config, run_dir, "trainer.resume_mode=disable")
    assert "trainer.resume_mode=disable starts a new run" in err and "metrics.jsonl" in err

    # The latest checkpoint damaged: named, with the earlier complete one.
    shard = sorted((ckpts / "global_step_2" / "actor").glob("__*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:64])
    err = _refused(config, run_dir, "trainer.total_training_steps=3")
    assert f"{shard}: truncated shard file (64 bytes" in err
    assert f"the earlier checkpoint {ckpts / 'global_step_1'} (step 1) is complete" in err

    # Asked to fall back: resumes from step 1, logs it, trains steps 2 and 3.
    metrics_before = read_metrics(run_dir)
    proc = run_train(config, "trainer.total_training_steps=3", "trainer.resume_fallback=true")
    assert proc.returncode == 0
    assert f"resuming from {ckpts / 'global_step_1'} (step 1) instead" in proc.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Step 1's line is kept as it was; steps 2 and 3 are those of the resumed run.
    assert [rec["step"] for rec in lines] == [1, 2, 3]
    assert lines[0]["metrics"] == metrics_before[1]
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "3"
