"""Run `megarl train` on the quickstart task as a subprocess and summarise its metrics.

The run writes `metrics.jsonl` (one line per step); this module reads the step and phase timings
from it, counts tokens, and samples the peak memory of the driver's process tree while it runs
(see `common.PeakMemorySampler`). Step 1 is a warm-up (first forward passes, allocator growth) and
is left out of every average.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from common import REPO_ROOT, PeakMemorySampler, load_average, mean

QUICKSTART = REPO_ROOT / "configs" / "quickstart_cpu.yaml"
# Phases of one megarl step, in the order they run (metric suffix of timing_s/<phase>).
PHASES = ("sync_weights", "gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")


# The quickstart's task, as `make demo` writes it (Makefile): a+b= with a, b in 0..4.
QUICKSTART_TASK = ["--num-operands", "2", "--min-value", "0", "--max-value", "4", "--operators", "+"]


def prepare_task(work_dir: Path, python: str = sys.executable) -> dict[str, Path]:
    """Write the quickstart's task (parquet + character tokenizer) once under `work_dir`. The
    folder is named after the task, so that data of another task left in a reused work folder is
    never picked up."""
    data = Path(work_dir) / "data_add_2x0-4"
    paths = {"train": data / "train.parquet", "val": data / "val.parquet", "tokenizer": data / "tokenizer"}
    if not (paths["train"].is_file() and (paths["tokenizer"] / "tokenizer.json").is_file()):
        subprocess.run(
            [python, "-m", "megarl.cli", "data", "make", "arithmetic", "--out", str(data),
             "--tokenizer-out", str(paths["tokenizer"]), *QUICKSTART_TASK],
            check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
        )
    return paths


def base_overrides(task: dict[str, Path], run_dir: Path, steps: int) -> list[str]:
    """Quickstart settings for a timed run: no validation, checkpoints, progress bar or mlflow."""
    return [
        f"data.train_files=[{task['train']}]",
        "data.val_files=[]",
        "data.val_batch_size=null",
        f"data.tokenizer={task['tokenizer']}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.progress_bar=false",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
        "tracking.backends=[jsonl]",
        "tracking.report_plots=false",
    ]


def one_worker_overrides() -> list[str]:
    return ["resources.actor_pool.devices_per_node=1", "actor.megatron.tensor_model_parallel_size=1"]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The lines of a metrics.jsonl file, in step order."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["step"])


def step_record(row: dict[str, Any], sequences: int) -> dict[str, Any]:
    """One step's timings (s), tokens and reward from a metrics.jsonl line.

    `sequences` is prompts x responses per prompt; response tokens = mean response length x that.
    """
    m = row["metrics"]
    response_tokens = (m.get("response_length/mean") or 0.0) * sequences
    record: dict[str, Any] = {
        "step": row["step"],
        "step_s": m.get("timing_s/step"),
        "logged_at": row.get("time"),  # unix seconds of the step's metrics line (wall clock between steps)
        "score_mean": m.get("critic/score/mean"),
        "total_tokens": m.get("perf/total_num_tokens"),
        "response_tokens": response_tokens,
        # the share of the rows (and their tokens) of zero advantage the update left out (absent: it ran every row)
        "update_rows_skipped": m.get("actor/zero_advantage_rows_skipped"),
        "update_tokens_skipped": m.get("actor/zero_advantage_tokens_skipped"),
        "old_log_prob_tokens_skipped": m.get("training/old_log_prob_tokens_skipped"),
    }
    for phase in PHASES:
        if f"timing_s/{phase}" in m:
            record[f"{phase}_s"] = m[f"timing_s/{phase}"]
    return record


def with_wall_seconds(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each record after the first gains `wall_s`: wall-clock seconds from the previous step's metrics
    line to its own, everything the run did between them (the step timer leaves out the driver's
    work between two steps, and work it overlaps with the next step's generation)."""
    for prev, cur in zip(records, records[1:]):
        if prev.get("logged_at") is not None and cur.get("logged_at") is not None:
            cur["wall_s"] = cur["logged_at"] - prev["logged_at"]
    return records


def wall_step_mean(records: list[dict[str, Any]]) -> float | None:
    """Mean `wall_s` of the steps after the first (None when no record has it)."""
    walls = [r["wall_s"] for r in records if r["step"] > 1 and r.get("wall_s") is not None]
    return mean(walls) if walls else None


def summarise_steps(records: list[dict[str, Any]], reward_window: int = 5) -> dict[str, Any]:
    """Averages over the steps after the first: step time, tokens/s, phase shares, final reward.

    Phase shares are each phase's total time over the total step time of the same steps; the rest
    of the step (data loading, metric computation, driver bookkeeping) is reported as `other`.
    """
    timed = [r for r in records if r["step"] > 1 and r.get("step_s")] or [r for r in records if r.get("step_s")]
    step_total = sum(r["step_s"] for r in timed)
    summary: dict[str, Any] = {
        "steps": len(records),
        "timed_steps": len(timed),
        "step_s_mean": mean([r["step_s"] for r in timed]),
        "wall_step_s_mean": wall_step_mean(records),
        "generated_tokens_per_s": (sum(r["response_tokens"] for r in timed) / step_total) if step_total else None,
        "training_tokens_per_s": (sum(r["total_tokens"] or 0 for r in timed) / step_total) if step_total else None,
    }
    shares: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for phase in PHASES:
        values = [r.get(f"{phase}_s", 0.0) for r in timed]
        if any(f"{phase}_s" in r for r in timed):
            seconds[phase] = sum(values) / len(timed)
            shares[phase] = sum(values) / step_total if step_total else 0.0
    if step_total:
        shares["other"] = max(0.0, 1.0 - sum(shares.values()))
        seconds["other"] = shares["other"] * step_total / len(timed)
    summary["phase_seconds_mean"] = seconds
    summary["phase_shares"] = shares
    summary["biggest_phase"] = max((p for p in shares if p != "other"), key=shares.get, default=None)
    gen_total = sum(r.get("gen_s", 0.0) for r in timed)
    summary["gen_phase_tokens_per_s"] = (sum(r["response_tokens"] for r in timed) / gen_total) if gen_total else None
    scores = [r["score_mean"] for r in records if r.get("score_mean") is not None]
    summary["reward_first"] = scores[0] if scores else None
    summary["reward_last_window_mean"] = mean(scores[-reward_window:])
    summary["reward_window"] = min(reward_window, len(scores))
    return summary


def run_megarl(
    run_dir: Path,
    overrides: list[str],
    *,
    prompts: int,
    n: int,
    timeout_s: float,
    threads_per_worker: int = 1,
    python: str = sys.executable,
    config: Path = QUICKSTART,
) -> dict[str, Any]:
    """Run `megarl train config overrides...`, sampling memory; return records, summary, memory.

    Raises RuntimeError (with the log's tail) when the run fails or writes no metrics.
    """
    run_dir = Path(run_dir)
    if run_dir.exists():  # a previous benchmark's run: start from nothing (no resume, no old metrics)
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    log_path = run_dir / "train.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_worker), TOKENIZERS_PARALLELISM="false",
               RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
    env.pop("RAY_ADDRESS", None)  # a local cluster of its own, never a shared one
    cmd = [python, "-m", "megarl.cli", "train", str(config), *overrides]
    load_before = load_average()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        with PeakMemorySampler(proc.pid) as memory:
            try:
                returncode: Optional[int] = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                returncode = None
    wall = time.perf_counter() - start
    metrics_path = run_dir / "metrics.jsonl"
    if returncode != 0 or not metrics_path.is_file():
        tail = log_path.read_text(errors="replace")[-3000:]
        reason = f"timed out after {timeout_s:.0f} s" if returncode is None else f"exit code {returncode}"
        raise RuntimeError(f"megarl train {reason}; log {log_path}:\n{tail}")
    records = with_wall_seconds([step_record(row, prompts * n) for row in read_metrics(metrics_path)])
    return {
        "command": ["megarl", "train", config.name, *overrides],
        "records": records,
        "summary": summarise_steps(records),
        "memory": memory.result(),
        "wall_s": round(wall, 2),
        "load_average_before": load_before,
        "load_average_after": load_average(),
    }
