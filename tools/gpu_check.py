"""The checks that `tools/gpu_check.sh` runs, one subcommand each (standard library + the bundle).

    python tools/gpu_check.py env [--cuda] [--bundle-python 3.12]   interpreter, torch, CUDA
    python tools/gpu_check.py deps                                   megarl's requirements satisfied?
    python tools/gpu_check.py imports                                import every megarl module
    python tools/gpu_check.py ray [--gpus N]                         local Ray cluster, tasks, actor
    python tools/gpu_check.py train-overrides --device cuda ...      the `megarl train` overrides
    python tools/gpu_check.py metrics RUN_DIR --steps N --probs-diff-tol X [--memory-out FILE] [--cuda]
    python tools/gpu_check.py bench-result FILE [--cuda]             benchmarks/gpu.py's JSON
    python tools/gpu_check.py reference-env DIR                      stand-in for the GPU image (CPU dry run)

Each subcommand prints what it found and exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import math
import os
import pkgutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bundle import (  # noqa: E402
    IMAGE_PACKAGES,
    LEFT_OUT,
    canonicalize_name,
    default_environment,
    runtime_requirements,
)

# The dry run's stand-in for the GPU image: the reference packages at versions megarl is tested
# with (transformers at the image's 5.17; torch CPU 2.13.0 stands in for the image's CUDA 2.11).
REFERENCE_TORCH = "torch==2.13.0"
REFERENCE_PACKAGES = ("transformers==5.17.*", "safetensors==0.8.0", "numpy>=2.0,<2.4", "pyarrow==25.0.1",
                      "pandas", "pyyaml", "psutil", "matplotlib>=3.9,<3.12", "tqdm", "pytest>=8.3,<10",
                      "hypothesis>=6.100")
# Third-party modules megarl imports at run time (beyond the image's own).
THIRD_PARTY_MODULES = ("ray", "ray.util.placement_group", "ray.util.scheduling_strategies", "ray._private.state",
                       "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
                       "megatron.core.dist_checkpointing", "omegaconf", "tensordict", "datasets")
# Metric names checked in the run's metrics.jsonl.
REWARD_KEY = "critic/score/mean"
LOSS_KEYS = ("actor/pg_loss", "actor/grad_norm")
SYNC_RECEIVED, SYNC_MINIMUM = "sync/bytes_received", "sync/bytes_minimum"
LOGPROB_DIFF_MAX = "training/rollout_logprob_abs_diff_max"  # max |rollout - trainer log-prob|
# The step's peak allocated device memory over the larger of its training-phase and rollout-phase
# peaks (megarl.tracking.memory.colocated_peak_ratio); logged with CUDA only.
PEAK_RATIO, PEAK_RATIO_MAX = "perf/colocated_peak_ratio", 1.1
BENCH_PARTS = ("train_step", "rollout", "sync", "prompt_sharing")


def _fail(lines: Iterable[str]) -> int:
    lines = list(lines)
    for line in lines:
        print(f"FAIL {line}")
    return 1 if lines else 0


# torch and ray are imported inside the checks that use them: a missing or broken one is a failed
# check with its message, and the subcommands that need neither run on a bare interpreter.


# ----------------------------------------------------------------------------------------- env
def cmd_env(args: argparse.Namespace) -> int:
    problems = []
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    print(f"python {sys.version.split()[0]} ({sys.executable})")
    if args.bundle_python and here != args.bundle_python:
        problems.append(f"the bundle is for CPython {args.bundle_python}, this interpreter is {here} "
                        f"(build one with tools/gpu_bundle.sh --python {here})")
    try:
        import torch
    except ImportError as err:
        return _fail([*problems, f"torch does not import: {err} (the image's torch is used, it is not bundled)"])
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), cuda available: {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            print(f"  cuda:{i} {props.name}, {props.total_memory / 2**30:.1f} GiB, "
                  f"capability {props.major}.{props.minor}")
        print(f"  bf16 supported: {torch.cuda.is_bf16_supported()}, nccl: {torch.distributed.is_nccl_available()}")
    elif args.cuda:
        problems.append("no CUDA device visible to torch (run with --dry-run on a CPU machine)")
    return _fail(problems)


# ---------------------------------------------------------------------------------------- deps
def requirement_report(root: str = "megarl") -> tuple[list[str], list[str]]:
    """(errors, notes) for the installed requirement graph from `root`: a missing distribution is an
    error unless LEFT_OUT names it; a version outside the pin is an error for a bundled package and
    a note for one the image provides (the image's torch and transformers differ from the pins)."""
    errors, notes = [], []
    env = dict(default_environment())
    left = {canonicalize_name(n) for n in LEFT_OUT if "[" not in n}
    seen: set[str] = set()
    todo = [canonicalize_name(root)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            errors.append(f"{name}: not installed")
            continue
        for req in runtime_requirements(dist.requires or [], env):
            dep = canonicalize_name(req.name)
            if dep in left:
                notes.append(f"{name} -> {req}: left out of the bundle ({LEFT_OUT[dep]})")
                continue
            for extra in sorted(req.extras):
                key = f"{dep}[{extra}]"
                notes.append(f"{name} -> {req}: extra [{extra}] " + (f"left out ({LEFT_OUT[key]})" if key in LEFT_OUT
                                                                     else "not checked"))
            try:
                version = md.version(dep)
            except md.PackageNotFoundError:
                errors.append(f"{name} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(version, prereleases=True):
                if dep in IMAGE_PACKAGES:
                    notes.append(f"{name} pins {req}; the image has {dep} {version}")
                else:
                    errors.append(f"{name} needs {req}, found {dep} {version}")
            todo.append(dep)
    return errors, notes


def cmd_deps(args: argparse.Namespace) -> int:
    errors, notes = requirement_report()
    for note in notes:
        print(f"note {note}")
    for dist in ("megarl", "ray", "megatron-core", "omegaconf", "tensordict", "datasets", "torch", "transformers"):
        try:
            where = Path(str(md.distribution(dist).locate_file(""))).resolve()
            print(f"{dist} {md.version(dist)} from {where}")
        except md.PackageNotFoundError:
            pass
    return _fail(errors)


# ------------------------------------------------------------------------------------- imports
def import_everything(package: str = "megarl", extra: Iterable[str] = THIRD_PARTY_MODULES) -> tuple[int, list[str]]:
    """Import every submodule of `package` and the `extra` modules; (count, failures)."""
    failures = []
    names = list(extra)
    pkg = importlib.import_module(package)
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, f"{package}.")]
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException as err:  # noqa: BLE001 - report every kind of import failure
            failures.append(f"{name}: {type(err).__name__}: {err}")
    return len(names), failures


def cmd_imports(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    count, failures = import_everything()
    print(f"imported {count - len(failures)}/{count} modules in {time.perf_counter() - start:.1f} s")
    return _fail(failures)


# ----------------------------------------------------------------------------------------- ray
def cmd_ray(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # this local, throwaway cluster only
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    start = time.perf_counter()
    # "local": a cluster of its own, whatever RAY_ADDRESS or a stale record of an earlier `ray start` names.
    ray.init(address="local", num_cpus=1, num_gpus=args.gpus, include_dashboard=False,
             object_store_memory=256 * 2**20, log_to_driver=False)
    problems = []
    try:
        print(f"ray {ray.__version__} from {Path(ray.__file__).parent}: "
              f"started in {time.perf_counter() - start:.1f} s, "
              f"resources {ray.cluster_resources()}")

        @ray.remote(num_cpus=0)
        def add(x: int) -> int:
            return x + 1

        @ray.remote(num_cpus=0)
        class Probe:
            def env(self, key: str) -> str | None:
                return os.environ.get(key)

            def cuda(self) -> tuple[bool, str | None]:
                import torch

                return torch.cuda.is_available(), os.environ.get("CUDA_VISIBLE_DEVICES")

        if ray.get(add.remote(1), timeout=120) != 2:
            problems.append("a remote call returned the wrong value")
        group = placement_group([{"CPU": 1, **({"GPU": 1} if args.gpus else {})}])
        ray.get(group.ready(), timeout=120)
        probe = Probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group),
                              num_gpus=1 if args.gpus else 0,
                              runtime_env={"env_vars": {"MEGARL_GPU_CHECK": "1"}}).remote()
        if ray.get(probe.env.remote("MEGARL_GPU_CHECK"), timeout=120) != "1":
            problems.append("an actor did not get its runtime_env env_vars")
        if args.gpus:
            available, visible = ray.get(probe.cuda.remote(), timeout=120)
            print(f"actor with 1 GPU: cuda available {available}, CUDA_VISIBLE_DEVICES={visible}")
            if not available:
                problems.append("an actor given a GPU cannot use CUDA")
        ray.kill(probe)
        remove_placement_group(group)
    finally:
        ray.shutdown()
    print(f"ray: tasks, placement group, actor checked in {time.perf_counter() - start:.1f} s")
    return _fail(problems)


# ---------------------------------------------------------------------------------------- train
def train_overrides(device: str, data_dir: str, run_dir: str, steps: int, devices: int = 1) -> list[str]:
    """Overrides of configs/quickstart_cpu.yaml for the check's `megarl train` run.

    cuda: bf16 on `devices` GPUs (TP=devices), a checkpoint at the last step; cpu: the quickstart's
    fp32 and TP=2 on two workers. The HF rollout engine either way (vLLM is not in the bundle).
    """
    common = [f"data.train_files=[{data_dir}/train.parquet]", f"data.val_files=[{data_dir}/val.parquet]",
              f"data.tokenizer={data_dir}/tokenizer", "data.val_batch_size=32", "rollout.engine=hf",
              "tracking.backends=[console,jsonl]", f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
              "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.experiment_name=gpu-check",
              f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable"]
    if device == "cuda":
        # Colocated memory phases: the actor's state in host memory outside its phases, the rollout
        # engine asleep outside generation (its default), so the step's peak can be checked.
        return common + ["resources.device=cuda", "model.dtype=bf16",
                         f"actor.megatron.tensor_model_parallel_size={devices}",
                         f"resources.actor_pool.devices_per_node={devices}", f"trainer.save_freq={steps}",
                         "actor.param_offload=true", "actor.grad_offload=true", "actor.optimizer_offload=true",
                         "rollout.free_cache_engine=true"]
    return common + ["resources.device=cpu", "model.dtype=fp32", "actor.megatron.tensor_model_parallel_size=2",
                     "resources.actor_pool.devices_per_node=2", "trainer.save_freq=-1"]


def cmd_train_overrides(args: argparse.Namespace) -> int:
    print("\n".join(train_overrides(args.device, args.data, args.run_dir, args.steps, args.devices)))
    return 0


def read_metrics(path: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            out[int(record["step"])] = record["metrics"]
    return out


def metric_problems(metrics: dict[int, dict[str, Any]], steps: int, probs_diff_tol: float,
                    cuda: bool = False) -> list[str]:
    """What is wrong with a run's metrics: missing steps; reward or a loss not finite (non-finite
    values are written as null); a weight sync that moved other than the plan's minimum bytes; the
    rollout engine's log-probs further than `probs_diff_tol` from the trainer's; a colocated peak
    ratio above PEAK_RATIO_MAX, or, with `cuda` (where it is logged), missing."""
    problems = []
    if sorted(metrics) != list(range(1, steps + 1)):
        problems.append(f"steps logged {sorted(metrics)}, expected 1..{steps}")
    synced = 0
    for step, m in sorted(metrics.items()):
        for key in (REWARD_KEY, *LOSS_KEYS):
            value = m.get(key)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                problems.append(f"step {step}: {key} = {value!r} (missing or not finite)")
        if SYNC_RECEIVED in m:
            synced += 1
            if m[SYNC_RECEIVED] != m.get(SYNC_MINIMUM):
                problems.append(f"step {step}: weight sync moved {m[SYNC_RECEIVED]} bytes, the plan's minimum is "
                                f"{m.get(SYNC_MINIMUM)}")
        diff = m.get(LOGPROB_DIFF_MAX)
        if diff is None or not math.isfinite(diff):
            problems.append(f"step {step}: {LOGPROB_DIFF_MAX} = {diff!r} (missing or not finite)")
        elif diff > probs_diff_tol:
            problems.append(f"step {step}: {LOGPROB_DIFF_MAX} = {diff:.3g} > {probs_diff_tol:g} (rollout and trainer "
                            "disagree on the same weights: a sync or numerics problem)")
        ratio = m.get(PEAK_RATIO)
        if cuda and not isinstance(ratio, (int, float)):
            # The summary promises this bound on CUDA: a run that did not log the ratio has not met it.
            problems.append(f"step {step}: {PEAK_RATIO} = {ratio!r} (missing; with CUDA it is logged and must be "
                            f"<= {PEAK_RATIO_MAX})")
        elif ratio is not None and ratio > PEAK_RATIO_MAX:
            problems.append(f"step {step}: {PEAK_RATIO} = {ratio:.3f} > {PEAK_RATIO_MAX} (training and rollout "
                            "state on the device together outside their phases)")
    if metrics and not synced:
        problems.append(f"no step logged {SYNC_RECEIVED}: the weight sync did not run")
    return problems


def memory_summary(metrics: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per step: the colocated peak ratio and each phase's peak allocated device memory (GiB)."""
    return {str(step): {"colocated_peak_ratio": m.get(PEAK_RATIO),
                        "max_allocated_gb": {k.split("/")[1]: v for k, v in m.items()
                                             if k.startswith("memory/") and k.endswith("/max_allocated_gb")}}
            for step, m in sorted(metrics.items())}


def cmd_metrics(args: argparse.Namespace) -> int:
    path = args.run_dir / "metrics.jsonl"
    if not path.is_file():
        return _fail([f"{path} not written"])
    metrics = read_metrics(path)
    for step, m in sorted(metrics.items()):
        print(f"step {step}: reward {m.get(REWARD_KEY)}, pg_loss {m.get('actor/pg_loss')}, "
              f"grad_norm {m.get('actor/grad_norm')}, sync {m.get(SYNC_RECEIVED)}/{m.get(SYNC_MINIMUM)} bytes, "
              f"logprob_abs_diff_max {m.get(LOGPROB_DIFF_MAX)}, colocated peak ratio {m.get(PEAK_RATIO)}")
    if args.memory_out is not None:
        args.memory_out.parent.mkdir(parents=True, exist_ok=True)
        args.memory_out.write_text(json.dumps({"limit": PEAK_RATIO_MAX, "steps": memory_summary(metrics)}, indent=1))
    return _fail(metric_problems(metrics, args.steps, args.probs_diff_tol, cuda=args.cuda))


# ---------------------------------------------------------------------------------------- bench
def bench_problems(result: dict[str, Any], cuda: bool) -> list[str]:
    """benchmarks/gpu.py's JSON: every part "ok" on a GPU; a recorded skip without one."""
    if not cuda:
        return [] if result.get("skipped") else [f"expected a skipped section without CUDA, got keys {sorted(result)}"]
    problems = []
    for part in BENCH_PARTS:
        status = (result.get(part) or {}).get("status")
        if status != "ok":
            problems.append(f"{part}: {status} {str((result.get(part) or {}).get('error', ''))[-600:]}")
    return problems


def cmd_bench_result(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        return _fail([f"{args.file} not written"])
    result = json.loads(args.file.read_text())
    train = result.get("train_step") or {}
    if "mfu_train_step" in train:
        print(f"device {result.get('device')}: MFU of the train step {train['mfu_train_step']}")
    for part in BENCH_PARTS:
        if part in result:
            print(f"{part}: {result[part].get('status')}")
    print("memory phases: the colocated peak ratio of the train step is in memory_phases.json beside this file")
    return _fail(bench_problems(result, args.cuda))


# ------------------------------------------------------------------------------- reference env
def cmd_reference_env(args: argparse.Namespace) -> int:
    """A clean virtual environment with only the reference image's packages (torch first, alone,
    so that nothing resolves it to the CUDA build)."""
    venv = args.dir
    stamp = venv / ".megarl-gpu-reference"
    spec = "\n".join([REFERENCE_TORCH, *REFERENCE_PACKAGES]) + "\n"
    if stamp.is_file() and stamp.read_text() == spec and (venv / "bin" / "python").exists():
        print(f"reference environment {venv} is up to date")
        return 0
    start = time.perf_counter()
    subprocess.run([args.python, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, REFERENCE_TORCH], check=True)
    subprocess.run([*pip, REFERENCE_TORCH, *REFERENCE_PACKAGES], check=True)
    stamp.write_text(spec)
    print(f"reference environment {venv} built in {time.perf_counter() - start:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("env")
    s.add_argument("--cuda", action="store_true", help="fail without a CUDA device")
    s.add_argument("--bundle-python", help="the bundle's Python version (X.Y)")
    sub.add_parser("deps")
    sub.add_parser("imports")
    s = sub.add_parser("ray")
    s.add_argument("--gpus", type=int, default=0)
    s = sub.add_parser("train-overrides")
    s.add_argument("--device", choices=("cpu", "cuda"), required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--run-dir", required=True)
    s.add_argument("--steps", type=int, required=True)
    s.add_argument("--devices", type=int, default=1)
    s = sub.add_parser("metrics")
    s.add_argument("run_dir", type=Path)
    s.add_argument("--steps", type=int, required=True)
    s.add_argument("--probs-diff-tol", type=float, required=True)
    s.add_argument("--memory-out", type=Path, default=None, help="write the per-phase device memory here (JSON)")
    s.add_argument("--cuda", action="store_true", help=f"the run was on CUDA: {PEAK_RATIO} must be logged")
    s = sub.add_parser("bench-result")
    s.add_argument("file", type=Path)
    s.add_argument("--cuda", action="store_true")
    s = sub.add_parser("reference-env")
    s.add_argument("dir", type=Path)
    s.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    handler = {"env": cmd_env, "deps": cmd_deps, "imports": cmd_imports, "ray": cmd_ray,
               "train-overrides": cmd_train_overrides, "metrics": cmd_metrics, "bench-result": cmd_bench_result,
               "reference-env": cmd_reference_env}[args.cmd]
    try:
        return handler(args)
    except Exception:  # noqa: BLE001 - a check that crashes is a failed check, with its traceback
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
