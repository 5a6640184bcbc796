"""The report of a run: PNG plots and ``summary.md``, written from ``metrics.jsonl`` alone.

``write_report(run_dir)`` can run at the end of training or any time later (``megarl report RUN_DIR``),
also while a run is still going. Output goes to ``<run_dir>/report/``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from megarl.tracking.jsonl import METRICS_FILE, read_metrics
from megarl.tracking.metrics import SELF_TIME_PREFIX
from megarl.tracking.plots import OUTSIDE_STEP_PHASES, RM_SCORE_KEY, MetricTable, validation_reward_keys, write_plots
from megarl.tracking.progress import format_duration

REPORT_DIR = "report"
SUMMARY_FILE = "summary.md"
REWARD_KEY = "critic/score/mean"
THROUGHPUT_KEY = "perf/throughput"
STEP_TIME_KEY = "timing_s/step"


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def _mean(values: list[float]) -> float:
    vals = _finite(values)
    return math.fsum(vals) / len(vals) if vals else math.nan


def _duration_text(seconds: float) -> str:
    """``12.3 s`` under a minute, else ``m:ss`` / ``h:mm:ss``."""
    return f"{seconds:.1f} s" if seconds < 60 else format_duration(seconds)


@dataclass
class PhaseShare:
    phase: str
    seconds: float
    share: float  # fraction of the summed step time (or of all phases when step time is missing)


def phase_shares(table: MetricTable) -> list[PhaseShare]:
    """Total time per phase of the step over the run, largest first (``timing_s/step`` is the total,
    not a phase; validation and checkpoints lie outside the step: `outside_step_totals`). A phase
    with phases nested in it counts its own time only (`MetricTable.phase_seconds`), so the shares
    add up to at most the step."""
    totals = {
        name[len("timing_s/") :]: math.fsum(_finite(table.phase_seconds(name)))
        for name in table.names
        if name.startswith("timing_s/") and name != STEP_TIME_KEY
        and name[len("timing_s/") :] not in OUTSIDE_STEP_PHASES
    }
    step_total = math.fsum(_finite(table.column(STEP_TIME_KEY))) if STEP_TIME_KEY in table.names else 0.0
    denom = step_total if step_total > 0 else math.fsum(totals.values())
    shares = [PhaseShare(p, s, s / denom if denom > 0 else math.nan) for p, s in totals.items()]
    return sorted(shares, key=lambda x: -x.seconds)


def summarize(table: MetricTable, run_name: str, k: Optional[int] = None) -> str:
    """The markdown text of ``summary.md``. ``k``: steps averaged at each end (default min(10, n//2), >= 1)."""
    n = len(table.steps)
    lines = [f"# Run summary: {run_name}", ""]
    if n == 0:
        return "\n".join(lines + ["No steps logged yet.", ""])
    k = k or min(10, max(1, n // 2))
    lines.append(f"- steps: {table.steps[0]}–{table.steps[-1]} ({n} logged)")
    if STEP_TIME_KEY in table.names:
        train_time = math.fsum(_finite(table.column(STEP_TIME_KEY)))
        lines.append(f"- training time (sum of step times): {_duration_text(train_time)}")
    times = [t for t in table.times if t is not None]
    if len(times) >= 2:
        lines.append(f"- wall time (first to last logged step): {_duration_text(times[-1] - times[0])}")
    if REWARD_KEY in table.names:
        rewards = table.series(REWARD_KEY)[1]  # steps that logged it (not validation-only steps)
        first, last = _mean(rewards[:k]), _mean(rewards[-k:])
        lines.append(
            f"- reward ({REWARD_KEY}): first {k} steps {first:.4f}, last {k} steps {last:.4f} ({last - first:+.4f})"
        )
    if RM_SCORE_KEY in table.names:
        scores = table.series(RM_SCORE_KEY)[1]
        first, last = _mean(scores[:k]), _mean(scores[-k:])
        lines.append(f"- reward-model score ({RM_SCORE_KEY}): first {k} steps {first:.4f}, last {k} steps "
                     f"{last:.4f} ({last - first:+.4f})")
    for key in validation_reward_keys(table.names)[:1]:
        points = [(s, v) for s, v in zip(table.steps, table.column(key)) if not math.isnan(v)]
        if points:
            (s0, v0), (s1, v1) = points[0], points[-1]
            lines.append(f"- validation reward ({key}): {v0:.4f} at step {s0} -> {v1:.4f} at step {s1}")
    if THROUGHPUT_KEY in table.names:
        lines.append(f"- throughput ({THROUGHPUT_KEY}): mean {_mean(table.column(THROUGHPUT_KEY)):.1f} tokens/s per device")
    outside = {p: math.fsum(_finite(table.column(f"timing_s/{p}"))) for p in OUTSIDE_STEP_PHASES
               if f"timing_s/{p}" in table.names}
    if outside:
        lines.append("- outside the steps: " + ", ".join(
            f"{'validation' if p == 'val' else 'checkpoints'} {_duration_text(s)}" for p, s in outside.items()))
    shares = phase_shares(table)
    if shares:
        top = shares[0]
        lines.append(f"- biggest phase: {top.phase}, {top.seconds:.1f} s in total ({100 * top.share:.1f}% of step time)")
        lines += ["", "| phase | total s | share of step time |", "|---|---:|---:|"]
        nested = {name[len(SELF_TIME_PREFIX):] for name in table.names if name.startswith(SELF_TIME_PREFIX)}
        lines += [f"| {p.phase}{' *' if p.phase in nested else ''} | {p.seconds:.2f} | {100 * p.share:.1f}% |"
                  for p in shares]
        if nested:
            lines += ["", "\\* without the phases timed inside it (e.g. the reward scored while the workers "
                      "compute the old log-probs), which have rows of their own"]
    return "\n".join(lines + [""])


def write_report(run_dir: Union[str, Path], k: Optional[int] = None) -> dict[str, Path]:
    """Write plots (PNG) and ``summary.md`` under ``<run_dir>/report/``.

    Returns ``{name: path}`` with ``summary`` and one entry per plot drawn (``reward``,
    ``reward_model``, ``response_length``, ``kl``, ``throughput``, ``timing``, ``memory``, ``entropy``; a plot whose metrics
    were never logged is skipped). Raises ``MetricsFileError`` without ``metrics.jsonl``.
    """
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / METRICS_FILE)
    table = MetricTable.from_records(records)
    out = run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    paths = write_plots(table, out)
    summary = out / SUMMARY_FILE
    summary.write_text(summarize(table, run_dir.resolve().name, k=k), encoding="utf-8")
    paths["summary"] = summary
    return paths

