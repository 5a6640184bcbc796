"""StepProfiler: Chrome traces for the listed steps only, one file per worker, written atomically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megarl.tracking.profiling import StepProfiler

pytestmark = pytest.mark.unit

MATMUL_OPS = {"aten::mm", "aten::matmul", "aten::addmm"}


def matmul_work() -> torch.Tensor:
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    return (a @ b).sum()


def test_listed_step_writes_a_chrome_trace_with_the_matmul(tmp_path: Path) -> None:
    profiler = StepProfiler([2, 4], tmp_path, role="actor", rank=3)
    assert profiler.start(2) is True
    assert profiler.active_step == 2
    matmul_work()
    path = profiler.stop()
    assert path == tmp_path / "step_2" / "actor_rank3.json"
    assert profiler.active_step is None
    trace = json.loads(path.read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert names & MATMUL_OPS, sorted(n for n in names if isinstance(n, str) and n.startswith("aten::"))
    assert [p.name for p in path.parent.iterdir()] == ["actor_rank3.json"]  # no temporary file left
    assert profiler.stop() is None  # nothing running any more


def test_unlisted_step_writes_nothing(tmp_path: Path) -> None:
    profiler = StepProfiler([2], tmp_path / "prof", role="rollout", rank=0)
    assert profiler.start(1) is False
    matmul_work()
    assert profiler.stop() is None
    with profiler.profiling(3):
        matmul_work()
    assert not (tmp_path / "prof").exists()


def test_context_manager_writes_the_trace_even_when_the_step_fails(tmp_path: Path) -> None:
    profiler = StepProfiler([5], tmp_path, role="critic", rank=1)
    with pytest.raises(ZeroDivisionError):
        with profiler.profiling(5):
            matmul_work()
            raise ZeroDivisionError
    path = tmp_path / "step_5" / "critic_rank1.json"
    names = {event.get("name") for event in json.loads(path.read_text())["traceEvents"]}
    assert names & MATMUL_OPS
    assert profiler.active_step is None


def test_start_twice_without_stop_is_an_error(tmp_path: Path) -> None:
    profiler = StepProfiler([1, 2], tmp_path, role="actor", rank=0)
    profiler.start(1)
    with pytest.raises(RuntimeError, match="step 1 is still being profiled"):
        profiler.start(2)
    with pytest.raises(RuntimeError, match="still being profiled"):
        profiler.start(7)  # even for a step that is not listed: the caller lost track of stop()
    assert profiler.stop() == tmp_path / "step_1" / "actor_rank0.json"


@pytest.mark.parametrize(
    ("steps", "role", "message"),
    [([1, "2"], "actor", "integers >= 0"), ([-1], "actor", "integers >= 0"), ([1], "act/or", "file-name part")],
)
def test_bad_arguments_are_refused(tmp_path: Path, steps: list, role: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepProfiler(steps, tmp_path, role=role, rank=0)
