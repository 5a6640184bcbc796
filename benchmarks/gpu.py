"""GPU section: runs only where CUDA is present; on a CPU machine it records that it was skipped.

- MFU of the train step: benchmarks/engine.py on a Qwen2.5-0.5B-shaped random model in bf16;
  MFU = 6 x parameters x train tokens/s / the GPU's peak dense bf16 FLOP/s (attention FLOPs left
  out, so this slightly understates the true utilisation).
- Rollout tokens/s, vLLM against the HF engine: benchmarks/rollout.py with bf16 and larger batches,
  the HF engine on the GPU (results before its --device ran it on the host's CPU).
- Weight sync: benchmarks/reshard.py at its largest size (100M parameters): two gloo processes on the
  host's CPU (the plan and executor's own cost; NCCL between GPUs is not measured here). The 0.5B-1.5B
  sizes of the issue need a size entry there; until then the 100M figure is the largest measured.
- Prompt sharing: benchmarks/engine.py on the same model with GRPO's layout (4 prompts x 8 responses,
  512-token prompts, 128-token responses): log-prob and train-step tokens/s with
  prompt_sharing=always ("engine_shared") against the padded engine, in one run.

    python benchmarks/gpu.py [--out benchmarks/results/sections/gpu.json]

The JSON is rewritten after each part, the parts not yet finished marked "not finished": a run
stopped from outside (tools/gpu_check.sh caps its bench step) keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO_ROOT, RESULTS_DIR, load_average, machine_info, write_json  # noqa: E402

# Peak dense bf16 tensor-core FLOP/s by device-name fragment (vendor data sheets, no sparsity).
# The longest fragment found in the name wins ("H100 PCIe" over "H100", "L40S" and "L40" over "L4").
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H200 NVL": 835e12,
    "H100": 989e12,  # SXM
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "A10": 125e12,
    "L4": 121e12,
}
# Qwen2.5-0.5B's shape (random weights, no download). The engine gets HF's own shape, all 32 sequences
# in one micro-batch: at 8 a log-prob pass spent 121.6 ms of host time launching 50.0 ms of GPU work
# (one H200, results/gpu_h200/profile_mb8/); engine/HF log-prob 0.43x, 0.61x, 1.06x and train step
# 0.50x, 0.75x, 1.15x at 8, 16, 32 sequences per micro-batch in one call (results/gpu_h200/engine_mb*.json).
ENGINE_0_5B = ["--hidden", "896", "--layers", "24", "--heads", "14", "--kv-heads", "2", "--vocab", "151936",
               "--batch", "32", "--prompt-len", "256", "--response-len", "256", "--micro-batch-size", "32",
               "--dtype", "bf16", "--repeats", "3"]
ENGINE_SHARED_0_5B = [*ENGINE_0_5B[:ENGINE_0_5B.index("--batch")], "--batch", "32", "--prompt-len", "512",
                      "--response-len", "128", "--micro-batch-size", "8", "--dtype", "bf16", "--repeats", "3",
                      "--group-size", "8"]
PARTS = ("train_step", "rollout", "sync", "prompt_sharing")  # in the order they run
NOT_FINISHED = {"status": "not finished", "error": "the run stopped before this part ended"}
ROLLOUT_ARGS = ["--num-prompts", "64", "--n", "8", "--max-new-tokens", "256", "--dtype", "bfloat16", "--repeats", "3"]


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device named like torch.cuda.get_device_name(); None if unknown."""
    found = [fragment for fragment in PEAK_BF16_FLOPS if fragment in device_name]
    return PEAK_BF16_FLOPS[max(found, key=len)] if found else None


def mfu(params: int, tokens_per_s: float, flops_peak: float | None) -> float | None:
    """Model FLOPs utilisation of a training step: 6 N T / peak (forward 2N + backward 4N per token)."""
    if flops_peak is None:
        return None
    return 6.0 * params * tokens_per_s / flops_peak


def _run_json(cmd: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    try:
        done = subprocess.run(cmd + ["--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"no result within {timeout_s:.0f} s"}
    if done.returncode != 0 or not out.is_file():
        return {"status": "failed", "error": (done.stdout[-1000:] + done.stderr[-2000:]).strip()}
    return {"status": "ok", "result": json.loads(out.read_text())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="accepted for symmetry; the GPU section has one size")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "sections" / "gpu.json")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        write_json(args.out, {"section": "gpu", "machine": machine_info(), "skipped": "no CUDA device on this machine"})
        print("gpu: skipped (no CUDA device)")
        return 0
    name = torch.cuda.get_device_name(0)
    parts_dir = args.out.parent / "gpu"
    parts_dir.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    bench = REPO_ROOT / "benchmarks"
    result: dict[str, Any] = {"section": "gpu", "machine": machine_info(), "device": name,
                              "peak_bf16_flops": peak_flops(name), **{part: dict(NOT_FINISHED) for part in PARTS}}
    write_json(args.out, result)
    engine = _run_json([py, str(bench / "engine.py"), *ENGINE_0_5B], parts_dir / "engine.json", args.timeout)
    if engine["status"] == "ok":
        r = engine["result"]
        tokens_per_s = r["train_step_tokens_per_s"]["engine"]
        engine["mfu_train_step"] = mfu(r["params"], tokens_per_s, peak_flops(name))
        engine["mfu_train_step_hf"] = mfu(r["params"], r["train_step_tokens_per_s"]["hf"], peak_flops(name))
    result["train_step"] = engine
    write_json(args.out, result)
    result["rollout"] = _run_json([py, str(bench / "rollout.py"), *ROLLOUT_ARGS], parts_dir / "rollout.json", args.timeout)
    write_json(args.out, result)
    result["sync"] = _run_json([py, str(bench / "reshard.py"), "--sizes", "100M", "--repeats", "3"],
                               parts_dir / "reshard.json", args.timeout)
    write_json(args.out, result)
    shared = _run_json([py, str(bench / "engine.py"), *ENGINE_SHARED_0_5B], parts_dir / "engine_shared.json",
                       args.timeout)
    if shared["status"] == "ok":
        r = shared["result"]
        shared["speedup"] = {phase: r[key]["engine_shared"] / r[key]["engine"] for phase, key in
                             (("log_prob", "log_prob_tokens_per_s"), ("train_step", "train_step_tokens_per_s"))}
    result["prompt_sharing"] = shared
    result["load_average_end"] = load_average()
    write_json(args.out, result)
    print(json.dumps({k: v.get("status") for k, v in result.items() if isinstance(v, dict) and "status" in v}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
