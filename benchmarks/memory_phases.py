"""Memory phases of the colocated hybrid engine, side by side in one run of this script.

Three `megarl train` runs of a ~25M-parameter Qwen2 (hidden 512, 8 layers, intermediate 1536, 8/4
heads) on the quickstart task, 2 workers at TP=2, HF rollout engine:
  resident   rollout.free_cache_engine=false: the rollout engine keeps its weight copy all step;
  sleep      the default: the rollout engine sleeps after generation (sleep_level 2 frees its
             weights) and is refilled by the next weight sync;
  offload    sleep + every actor offload key.
For each, the per-phase peak resident set of the largest worker (`memory/<phase>/peak_rss_gb`, read
by the workers themselves: Linux VmHWM reset between phases) averaged over the steps after the
first, and the step time. The claim checked: during the update the sleeping engine's workers peak
lower by at least the rollout engine's weight copy (parameters x 4 bytes in fp32). On a CPU machine
offloading moves bytes within the same memory, so the offload run shows only its time cost.

    python benchmarks/memory_phases.py [--steps 3] [--out benchmarks/results/memory_phases.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, mean, ratio, write_json  # noqa: E402
from megarl_run import base_overrides, prepare_task, read_metrics, run_megarl  # noqa: E402

MODEL = ["model.hf_config.hidden_size=512", "model.hf_config.num_hidden_layers=8",
         "model.hf_config.intermediate_size=1536", "model.hf_config.num_attention_heads=8",
         "model.hf_config.num_key_value_heads=4", "model.hf_config.max_position_embeddings=128"]
SHAPE = ["resources.actor_pool.devices_per_node=2", "actor.megatron.tensor_model_parallel_size=2",
         "rollout.engine=hf", "data.max_response_length=32", "actor.optim.lr=1e-5"]
VARIANTS = {
    "resident": ["rollout.free_cache_engine=false"],
    "sleep": ["rollout.free_cache_engine=true", "rollout.sleep_level=2"],
    "offload": ["rollout.free_cache_engine=true", "rollout.sleep_level=2", "actor.param_offload=true",
                "actor.grad_offload=true", "actor.optimizer_offload=true"],
}
PHASES = ("sync_weights", "gen", "old_log_prob", "update_actor")


def phase_peaks(run_dir: Path) -> dict[str, float]:
    """Mean over steps > 1 of each phase's peak resident set (GiB, largest worker)."""
    rows = [r["metrics"] for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 1]
    # A phase a run skips has no peak (old_log_prob, when the update supplies the old log-probs).
    return {p: mean(values) for p in PHASES
            if (values := [m[f"memory/{p}/peak_rss_gb"] for m in rows if f"memory/{p}/peak_rss_gb" in m])}


def model_parameters(run_dir: Path) -> int:
    from safetensors import safe_open  # only here: the rest of the script needs no torch

    with safe_open(str(run_dir / "initial_model" / "model.safetensors"), framework="pt") as f:
        return sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())


def _prod(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=None, help="runs and data (default: a temporary folder)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "memory_phases.json"))
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="megarl_bench_memory_"))
    task = prepare_task(work)
    results: dict[str, Any] = {}
    for name, extra in VARIANTS.items():
        run_dir = work / name
        out = run_megarl(run_dir, base_overrides(task, run_dir, args.steps) + MODEL + SHAPE + extra,
                         prompts=8, n=8, timeout_s=1800)
        results[name] = {"phase_peak_rss_gb": phase_peaks(run_dir), "step_s_mean": out["summary"]["step_s_mean"],
                         "phase_seconds_mean": out["summary"]["phase_seconds_mean"],
                         "overrides": MODEL + SHAPE + extra}
        print(f"{name:9s} step {results[name]['step_s_mean']:.2f} s  " +
              "  ".join(f"{p} {v:.3f} GiB" for p, v in results[name]["phase_peak_rss_gb"].items() if v is not None))
    params = model_parameters(work / "resident")
    weight_copy_gb = params * 4 / 2**30
    drop = results["resident"]["phase_peak_rss_gb"]["update_actor"] - results["sleep"]["phase_peak_rss_gb"]["update_actor"]
    summary = {
        "parameters": params,
        "rollout_weight_copy_gb": weight_copy_gb,
        "update_peak_drop_gb": drop,
        "drop_over_weight_copy": ratio(drop, weight_copy_gb),
        "step_time_sleep_over_resident": ratio(results["sleep"]["step_s_mean"], results["resident"]["step_s_mean"]),
        "step_time_offload_over_resident": ratio(results["offload"]["step_s_mean"], results["resident"]["step_s_mean"]),
    }
    print(f"update-phase peak: resident - sleep = {drop:.3f} GiB; the rollout weight copy is {weight_copy_gb:.3f} GiB "
          f"({summary['drop_over_weight_copy']:.2f}x); step time sleep/resident "
          f"{summary['step_time_sleep_over_resident']:.2f}, offload/resident {summary['step_time_offload_over_resident']:.2f}")
    path = write_json(args.out, {"machine": machine_info(), "steps": args.steps, "variants": results, "summary": summary})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
