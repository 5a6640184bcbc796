"""Run the component benchmarks (algorithms, engine, reshard, rollout, convert, recompute, memory
phases, per-rank sync planning at scale, padding removal / dynamic micro-batches, a batch's trip to a
worker, CPU gradient sums, half-precision attention, the local spec's SwiGLU and RMSNorm), each in its own process with its own
time limit, and collect the JSON each one writes.

A component that is missing, fails or runs out of time is recorded with its error; the others
still run. `--quick` passes small sizes (a component not listed in QUICK_ARGS gets its own `--quick`, if it has one).
The rollout benchmark runs in the vLLM environment (`.venv-vllm`) where that exists, so that vLLM
is measured next to the HF engine; otherwise in this interpreter (HF engine only).

    python benchmarks/components.py [--components algorithms,engine] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO_ROOT, RESULTS_DIR, load_average, machine_info, utc_now, write_json  # noqa: E402

BENCH_DIR = REPO_ROOT / "benchmarks"
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
COMPONENTS = ("algorithms", "engine", "reshard", "rollout", "convert", "recompute", "memory_phases", "plan_scale",
              "reliability", "packing", "batch_transfer", "host_reduce", "attention", "local_modules")

# Small sizes for a smoke run, used when a component has no --quick of its own.
QUICK_ARGS: dict[str, list[str]] = {
    "algorithms": ["--responses", "4096", "--length", "64", "--reference-responses", "64", "--repeats", "1"],
    "engine": ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "512",
               "--batch", "8", "--prompt-len", "16", "--response-len", "16", "--micro-batch-size", "4",
               "--repeats", "1"],
    "reshard": ["--sizes", "10M", "--repeats", "1"],
    "rollout": ["--num-prompts", "4", "--n", "2", "--max-new-tokens", "8", "--repeats", "1", "--engines", "hf"],
    "convert": ["--hidden", "256", "--layers", "2", "--vocab", "4096"],
    "recompute": ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "512",
                  "--batch", "4", "--prompt-len", "16", "--response-len", "32", "--micro-batch-size", "4",
                  "--repeats", "1"],
    "memory_phases": ["--steps", "2"],
    "plan_scale": ["--layouts", "8x4x2", "--compare-full", "0"],
    "reliability": ["--no-resume"],
    "packing": ["--sizes", "quickstart", "--rows", "16", "--repeats", "1"],
    "batch_transfer": ["--repeats", "20"],
    "host_reduce": ["--sizes", "2368000", "--repeats", "5"],
    "attention": ["--repeats", "1", "--skip-train-step"],
    "local_modules": ["--repeats", "1", "--skip-train-step"],
}
# Full runs: sizes that finish in minutes on a 2-core machine (each script's defaults otherwise).
FULL_ARGS: dict[str, list[str]] = {
    "algorithms": ["--responses", "65536", "--length", "256"],
    # All four parts ran past the 900 s limit on a 2-core machine; dense took 51 s and each MoE part
    # about 350 s. The MoE parts into the HF engine and with whole experts: plan_scale.py itself.
    "plan_scale": ["--parts", "dense,moe_vllm"],
}
THREADS = {"algorithms": 2, "engine": 2, "rollout": 2, "reshard": 1, "convert": 2, "recompute": 2, "memory_phases": 1,
           "plan_scale": 1, "reliability": 1, "packing": 2, "batch_transfer": 1, "host_reduce": 1,
           "attention": 1, "local_modules": 1}


def _help_text(python: str, script: Path) -> str:
    try:
        done = subprocess.run([python, str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return ""
    return done.stdout


def command_for(name: str, quick: bool, out: Path, python: str) -> list[str]:
    """The command line of one component benchmark."""
    script = BENCH_DIR / f"{name}.py"
    if quick and name in QUICK_ARGS:
        extra = QUICK_ARGS[name]
    elif quick:
        extra = ["--quick"] if "--quick" in _help_text(python, script) else []
    else:
        extra = FULL_ARGS.get(name, [])
    return [python, str(script), *extra, "--out", str(out)]


def interpreter_for(name: str) -> str:
    if name == "rollout" and VLLM_PYTHON.is_file():
        return str(VLLM_PYTHON)
    return sys.executable


def run_component(name: str, quick: bool, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Run one component; returns {status, seconds, result | error, command, load averages}."""
    script = BENCH_DIR / f"{name}.py"
    entry: dict[str, Any] = {"load_average_before": load_average(),
                             "measured_utc": utc_now()}
    if not script.is_file():
        return {**entry, "status": "missing", "error": f"benchmarks/{name}.py does not exist"}
    out = out_dir / f"{name}.json"
    if out.exists():
        out.unlink()
    python = interpreter_for(name)
    cmd = command_for(name, quick, out, python)
    entry["command"] = [Path(cmd[0]).name, *[str(Path(c).relative_to(REPO_ROOT)) if c.startswith(str(REPO_ROOT)) else c
                                             for c in cmd[1:]]]
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS.get(name, 2)), TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {**entry, "status": "timeout", "seconds": round(time.perf_counter() - start, 1),
                "error": f"no result within {timeout_s:.0f} s"}
    entry["seconds"] = round(time.perf_counter() - start, 1)
    entry["load_average_after"] = load_average()
    if done.returncode != 0 or not out.is_file():
        return {**entry, "status": "failed", "error": (done.stdout[-1000:] + done.stderr[-2000:]).strip()}
    entry["status"] = "ok"
    entry["result"] = json.loads(out.read_text())
    entry["printed"] = done.stdout[-3000:].replace(str(out_dir) + "/", "")  # results name no folder of this machine
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--components", default=",".join(COMPONENTS), help=f"comma-separated, from {','.join(COMPONENTS)}")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--timeout", type=float, default=900, help="seconds per component")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "sections" / "components.json")
    args = p.parse_args(argv)
    names = [c for c in args.components.split(",") if c]
    unknown = [c for c in names if c not in COMPONENTS]
    if unknown:
        raise SystemExit(f"--components: unknown {unknown}; known: {list(COMPONENTS)}")
    out_dir = args.out.parent / "components"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {name: run_component(name, args.quick, out_dir, args.timeout) for name in names}
    write_json(args.out, {"section": "components", "machine": machine_info(), "quick": args.quick,
                          "components": results, "load_average_end": load_average()})
    print(json.dumps({k: v["status"] for k, v in results.items()}))
    return 0 if any(v["status"] == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
