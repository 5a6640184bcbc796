"""`trainer.val_only` over a run's checkpoint adds its line to `memory_phases.jsonl` and keeps the
later steps' lines, as it does in metrics.jsonl (before, the file was cut after the checkpoint's
step). `RLTrainer.train_until_done_or_stopped` runs on a stand-in trainer."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.trainer.loop import MEMORY_TRACE_FILE, RLTrainer

pytestmark = pytest.mark.unit


def _trainer(run_dir: Path, resume_step: int | None) -> SimpleNamespace:
    trainer = SimpleNamespace(global_step=0, memory_trace=[], logged=[])
    trainer.cfg = SimpleNamespace(trainer=SimpleNamespace(val_only=True, val_before_train=True))
    trainer.run = SimpleNamespace(run_dir=run_dir, val_dataset=object(),
                                  resume=None if resume_step is None else (resume_step, run_dir / "checkpoints"))
    trainer.checkpointer = SimpleNamespace(load=lambda resume: None if resume is None else {"global_step": resume[0]})

    def load_state_dict(state: dict) -> None:
        trainer.global_step = state["global_step"]

    def validate() -> dict[str, float]:
        trainer.memory_trace = [["rollout", "gen", "sleep"]]
        return {"val/reward": 0.5}

    trainer.load_state_dict = load_state_dict
    trainer.validate = validate
    trainer.outside_step_metrics = lambda: {}
    trainer.tracker = SimpleNamespace(log=lambda metrics, step: trainer.logged.append(step))
    trainer.write_memory_trace = lambda step, **marks: RLTrainer.write_memory_trace(trainer, step, **marks)
    return trainer


def _steps(run_dir: Path) -> list[tuple[int, bool]]:
    lines = (run_dir / MEMORY_TRACE_FILE).read_text().splitlines()
    return [(json.loads(line)["step"], json.loads(line).get("validation_only", False)) for line in lines]


def test_a_validation_only_pass_over_a_checkpoint_keeps_the_later_steps(tmp_path: Path) -> None:
    (tmp_path / MEMORY_TRACE_FILE).write_text("".join(json.dumps({"step": s, "transitions": []}) + "\n"
                                                      for s in (1, 2, 3, 4)))
    trainer = _trainer(tmp_path, resume_step=2)
    assert RLTrainer.train_until_done_or_stopped(trainer) == {"val/reward": 0.5}
    assert trainer.logged == [2]
    assert _steps(tmp_path) == [(1, False), (2, False), (3, False), (4, False), (2, True)]


def test_a_validation_only_pass_without_a_checkpoint_starts_the_file_anew(tmp_path: Path) -> None:
    (tmp_path / MEMORY_TRACE_FILE).write_text(json.dumps({"step": 3, "transitions": []}) + "\n")
    RLTrainer.train_until_done_or_stopped(_trainer(tmp_path, resume_step=None))
    assert _steps(tmp_path) == [(0, True)]
