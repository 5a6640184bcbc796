"""What the GPU check's Python parts decide, checked on CPU: the train step's metrics verdict on CUDA
(the colocated peak ratio must be there), benchmarks/gpu.py's JSON when the run is stopped between
parts, and the bundle builder's choice among cached wheels of several versions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_gpu_modules import _load  # the same module names: one module each

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]



# ------------------------------------------------------------- tools/gpu_check.py metrics
def _metrics_file(run: Path, with_ratio: bool) -> None:
    metrics = {"critic/score/mean": 0.5, "actor/pg_loss": -0.01, "actor/grad_norm": 1.0,
               "sync/bytes_received": 100.0, "sync/bytes_minimum": 100.0,
               "training/rollout_logprob_abs_diff_max": 1e-6}
    if with_ratio:
        metrics["perf/colocated_peak_ratio"] = 1.02
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "metrics": metrics}) + "\n")


def _metrics_check(run: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "metrics", str(run), "--steps", "1",
                           "--probs-diff-tol", "1e-3", *flags], capture_output=True, text=True, timeout=120)


def test_on_cuda_a_run_without_the_colocated_peak_ratio_fails(tmp_path: Path):
    _metrics_file(tmp_path / "run", with_ratio=False)
    on_cuda = _metrics_check(tmp_path / "run", "--cuda")
    assert on_cuda.returncode == 1, on_cuda.stdout + on_cuda.stderr
    assert "perf/colocated_peak_ratio" in on_cuda.stdout and "FAIL" in on_cuda.stdout
    # Without CUDA (the dry run) the ratio is not logged, and its absence is not a failure.
    on_cpu = _metrics_check(tmp_path / "run")
    assert on_cpu.returncode == 0, on_cpu.stdout + on_cpu.stderr


def test_on_cuda_a_run_with_the_colocated_peak_ratio_passes(tmp_path: Path):
    _metrics_file(tmp_path / "run", with_ratio=True)
    done = _metrics_check(tmp_path / "run", "--cuda")
    assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------------- benchmarks/gpu.py
class _Stopped(BaseException):
    """Stands in for the bench step's cap ending the process between two parts."""


def test_the_gpu_benchmark_json_keeps_the_parts_finished_before_a_stop(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    import torch

    gpu = _load(REPO / "benchmarks" / "gpu.py", "megarl_bench_gpu")
    gpu_check = _load(REPO / "tools" / "gpu_check.py", "gpu_check")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    calls = []

    def fake_run_json(cmd: list[str], out: Path, timeout_s: float) -> dict:
        calls.append(Path(cmd[1]).name)
        if len(calls) == 1:
            return {"status": "ok", "result": {"params": 494_000_000,
                                               "train_step_tokens_per_s": {"engine": 20_000.0, "hf": 10_000.0}}}
        if len(calls) == 2:
            return {"status": "ok", "result": {"tokens_per_s": 1.0}}
        raise _Stopped  # the third part (the weight sync) never ends

    monkeypatch.setattr(gpu, "_run_json", fake_run_json)
    out = tmp_path / "bench" / "gpu.json"
    with pytest.raises(_Stopped):
        gpu.main(["--out", str(out)])
    result = json.loads(out.read_text())
    assert result["train_step"]["status"] == "ok" and result["rollout"]["status"] == "ok"
    assert result["train_step"]["mfu_train_step"] == pytest.approx(6 * 494e6 * 20_000 / 989e12)
    # The unfinished parts are there and not "ok", so the verdict names them.
    problems = gpu_check.bench_problems(result, cuda=True)
    assert [p.split(":")[0] for p in problems] == ["sync", "prompt_sharing"]


# ------------------------------------------------------------------ tools/gpu_bundle.py
def test_assemble_picks_the_pinned_version_among_cached_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    gpu_bundle = _load(REPO / "tools" / "gpu_bundle.py", "gpu_bundle")
    wheels = tmp_path / "wheels-cp312"
    wheels.mkdir()
    tag = "cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
    # The old pin sorts after the new one by name: "2026.9.1" > "2026.10.0" as strings.
    for version in ("2026.10.0", "2026.9.1"):
        (wheels / f"rpds_py-{version}-{tag}").write_bytes(b"")
    monkeypatch.setattr(gpu_bundle, "BUNDLE_PACKAGES", {"rpds-py": "2026.10.0"})
    unpacked = []

    class Chosen(Exception):
        pass

    def record(chosen: list[Path], site: Path) -> None:
        unpacked.extend(p.name for p in chosen)
        raise Chosen  # the choice is made; the rest of assemble needs real wheels

    monkeypatch.setattr(gpu_bundle, "unpack_wheels", record)
    with pytest.raises(Chosen):
        gpu_bundle.assemble(wheels, tmp_path / "stage", "3.12", "bundle")
    assert unpacked == [f"rpds_py-2026.10.0-{tag}"]


def test_assemble_names_the_versions_found_when_the_pin_is_missing(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    gpu_bundle = _load(REPO / "tools" / "gpu_bundle.py", "gpu_bundle")
    wheels = tmp_path / "wheels-cp312"
    wheels.mkdir()
    (wheels / "rpds_py-2026.9.1-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"")
    monkeypatch.setattr(gpu_bundle, "BUNDLE_PACKAGES", {"rpds-py": "2026.10.0"})
    with pytest.raises(SystemExit, match=r"2026\.10\.0") as raised:
        gpu_bundle.assemble(wheels, tmp_path / "stage", "3.12", "bundle")
    assert "2026.9.1" in str(raised.value)
