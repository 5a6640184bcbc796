"""The offline GPU bundle, built and dry-run on this CPU machine (issue #16).

`tools/gpu_bundle.sh` builds the bundle for this interpreter's CPython version (the same pruning
and package list as the cp312 bundle for the GPU image); `tools/gpu_check.sh --dry-run` unpacks it
into a private directory and runs the CPU-checkable parts with a clean virtual environment that
holds only the reference image's packages (`.venv-gpu-ref`, kept between runs, rebuilt when its
package list changes). A failed build fails these tests: nothing here skips.

The archive is compressed with `xz -1` here for speed; the shipped one (`xz -9e`) is smaller still,
so staying under the limit here implies staying under it there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[3]
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"
LIMIT = 60 * 1024 * 1024
REFERENCE_VENV = REPO / ".venv-gpu-ref"
STEPS = ["env", "deps", "imports", "ray", "unit", "gpu-tests", "train", "bench"]


def _run(cmd: list[str], timeout: int) -> subprocess.CompletedProcess:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    print(f"$ {' '.join(cmd)}\n({time.perf_counter() - start:.0f} s, exit {done.returncode})\n{done.stdout[-6000:]}")
    if done.returncode != 0:
        print(done.stderr[-6000:])
    return done


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu-bundle")
    done = _run(["bash", str(REPO / "tools" / "gpu_bundle.sh"), "--python", PY, "--out", str(out), "--level", "1"],
                timeout=900)
    assert done.returncode == 0, f"tools/gpu_bundle.sh failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return out / f"megarl-gpu-bundle-{TAG}.tar.xz"


@pytest.fixture(scope="module")
def reference_python() -> Path:
    done = _run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "reference-env", str(REFERENCE_VENV),
                 "--python", sys.executable], timeout=1200)
    assert done.returncode == 0, f"reference environment failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return REFERENCE_VENV / "bin" / "python"


def test_bundle_is_under_the_limit_and_holds_what_megarl_needs(bundle: Path):
    size = bundle.stat().st_size
    assert size < LIMIT, f"{bundle.name}: {size / 2**20:.1f} MiB"
    with tarfile.open(bundle, "r:xz") as tar:
        names = set(tar.getnames())
        manifest = json.load(tar.extractfile(f"megarl-gpu-bundle-{TAG}/MANIFEST.json"))
    root = f"megarl-gpu-bundle-{TAG}"
    for path in ("site/ray/__init__.py", "site/ray/_raylet.so", "site/ray/core/src/ray/raylet/raylet",
                 "site/ray/core/src/ray/gcs/gcs_server", "site/megatron/core/__init__.py",
                 "site/omegaconf/__init__.py", "site/tensordict/__init__.py", "site/datasets/__init__.py",
                 "site/megarl-0.1.0.dist-info/METADATA", "src/megarl/__init__.py", "src/model_specs/qwen2.yaml",
                 "src/configs/quickstart_cpu.yaml", "src/tests/gpu/test_engine_gpu.py", "src/benchmarks/gpu.py",
                 "src/tools/gpu_check.py", "gpu_check.sh"):
        assert f"{root}/{path}" in names, f"{path} missing from the bundle"
    for pruned in ("site/ray/jars", "site/ray/rllib", "site/ray/tune", "site/ray/serve", "site/ray/data",
                   "site/ray/train", "site/ray/dashboard/client"):
        assert not any(n.startswith(f"{root}/{pruned}/") for n in names), f"{pruned} was not pruned"
    assert not any("/site/torch/" in n or "/site/transformers/" in n for n in names), "the image's packages are bundled"
    assert manifest["python"] == PY
    assert {"ray", "megatron-core", "omegaconf", "tensordict", "datasets", "megarl"} <= set(manifest["packages"])
    assert "mlflow" not in manifest["packages"]


def test_dry_run_of_the_gpu_check_passes(bundle: Path, reference_python: Path, tmp_path: Path):
    out = tmp_path / "check"
    done = _run(["bash", str(REPO / "tools" / "gpu_check.sh"), str(bundle), "--dry-run",
                 "--python", str(reference_python), "--out", str(out)], timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert done.returncode == 0 and summary["passed"], (out / "summary.txt").read_text()
    assert [s["name"] for s in summary["steps"]] == STEPS
    assert all(s["status"] == "passed" for s in summary["steps"]), summary["steps"]
    metrics = [json.loads(line) for line in (out / "train" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert json.loads((out / "bench" / "gpu.json").read_text())["skipped"]
    # The bundled packages came from the unpacked bundle, not from the reference environment.
    origins = [line for line in (out / "logs" / "deps.log").read_text().splitlines() if " from " in line]
    ray_line = next(line for line in origins if line.startswith("ray "))
    assert REFERENCE_VENV.name not in ray_line and ray_line.endswith("/site"), origins


def test_a_failed_step_fails_the_check_and_the_next_steps_still_run(bundle: Path, reference_python: Path,
                                                                   tmp_path: Path):
    # The GPU mode on a machine without CUDA: env fails, deps still runs (and passes), exit status 1.
    out = tmp_path / "check"
    done = _run(["bash", str(REPO / "tools" / "gpu_check.sh"), str(bundle), "--python", str(reference_python),
                 "--out", str(out), "--skip", "imports,ray,unit,gpu-tests,train,bench"], timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    assert done.returncode == 1 and not summary["passed"]
    status = {s["name"]: s["status"] for s in summary["steps"]}
    assert list(status) == STEPS
    assert status["env"].startswith("FAILED") and status["deps"] == "passed"
    assert "no CUDA device" in (out / "logs" / "env.log").read_text()
