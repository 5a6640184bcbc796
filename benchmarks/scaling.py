"""How the cost of a megarl step grows: 1 vs 2 workers, and the model doubled twice.

Workers: the quickstart step at 1 worker and at 2 workers (the quickstart's DP=2), one thread each.
Model size: the 2-worker step with 4, 8 and 16 layers (the character vocabulary is tiny, so the
parameter count doubles with the layer count). Reported per run: mean step time (steps 2..N),
the time of each phase, tokens/s, peak memory, and the ratio of each run's step time to the base
(2 workers, 4 layers).

    python benchmarks/scaling.py [--steps 6] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, load_average, machine_info, parameter_count, ratio, write_json  # noqa: E402
from megarl_run import base_overrides, one_worker_overrides, prepare_task, run_megarl  # noqa: E402

PROMPTS, N, BASE_LAYERS = 8, 8, 4


def plan() -> list[tuple[str, int, int]]:
    """(run name, workers, layers); the base run (2 workers, 4 layers) serves both sweeps."""
    return [("workers=1", 1, BASE_LAYERS), ("workers=2 (base)", 2, BASE_LAYERS), ("layers=8", 2, 8), ("layers=16", 2, 16)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="3 steps per run")
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "sections" / "scaling.json")
    args = p.parse_args(argv)
    steps = 3 if args.quick else args.steps
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="megarl-bench-scaling-"))
    task = prepare_task(work)
    runs: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for name, workers, layers in plan():
        run_dir = work / f"scaling_w{workers}_l{layers}"
        overrides = base_overrides(task, run_dir, steps) + [f"model.hf_config.num_hidden_layers={layers}"]
        if workers == 1:
            overrides += one_worker_overrides()
        try:
            run = run_megarl(run_dir, overrides, prompts=PROMPTS, n=N, timeout_s=args.timeout)
        except RuntimeError as err:
            errors[name] = str(err)[-2000:]
            continue
        s = run["summary"]
        runs.append({
            "name": name, "workers": workers, "layers": layers,
            "parameters": parameter_count(run_dir / "initial_model"),
            "step_s_mean": s["step_s_mean"],
            "phase_seconds_mean": s["phase_seconds_mean"],
            "generated_tokens_per_s": s["generated_tokens_per_s"],
            "training_tokens_per_s": s["training_tokens_per_s"],
            "peak_memory_workload_mib": run["memory"]["workload_mib"],
            "timed_steps": s["timed_steps"],
            "load_average_before": run["load_average_before"],
            "load_average_after": run["load_average_after"],
        })
    base = next((r for r in runs if r["workers"] == 2 and r["layers"] == BASE_LAYERS), None)
    for r in runs:
        r["step_time_over_base"] = ratio(r["step_s_mean"], base["step_s_mean"]) if base else None
    result = {"section": "scaling", "machine": machine_info(), "steps": steps, "runs": runs, "errors": errors,
              "load_average_end": load_average()}
    write_json(args.out, result)
    print(json.dumps([{k: r[k] for k in ("name", "parameters", "step_s_mean", "step_time_over_base")} for r in runs],
                     indent=2))
    return 1 if errors and not runs else 0


if __name__ == "__main__":
    raise SystemExit(main())
