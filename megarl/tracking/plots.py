"""PNG plots of a run's metrics (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megarl.tracking.metrics import SELF_TIME_PREFIX

# The policy-update KL, the KL loss term, and the KL penalised in the reward (use_kl_in_reward).
KL_KEYS = ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty")
# Phases timed after a step (validation, checkpoint), logged with it, not part of timing_s/step.
OUTSIDE_STEP_PHASES = ("val", "save_checkpoint")
RM_SCORE_KEY = "reward_model/score/mean"
MAX_VAL_CURVES = 4
MAX_PHASES = 10  # phases beyond the largest ones are drawn as "other"
SMOOTH_FROM = 30  # curves with more points than this get a moving average


@dataclass
class MetricTable:
    """Metrics by step: ``column(name)[i]`` is the value at ``steps[i]`` (NaN where not logged)."""

    steps: list[int]
    times: list[Optional[float]]
    values: dict[str, list[float]]

    @classmethod
    def from_records(cls, records: list[dict[str, Any]]) -> "MetricTable":
        names = sorted({name for r in records for name in r["metrics"]})
        return cls(
            steps=[r["step"] for r in records],
            times=[r.get("time") for r in records],
            values={n: [r["metrics"].get(n, math.nan) for r in records] for n in names},
        )

    @property
    def names(self) -> list[str]:
        return list(self.values)

    def column(self, name: str) -> list[float]:
        return self.values.get(name, [math.nan] * len(self.steps))

    def phase_seconds(self, name: str) -> list[float]:
        """Per step, the seconds of phase `name` (a ``timing_s/`` key) counted once: its own time
        (``timing_self_s/``) at steps where phases nested in it were timed, else its time."""
        own = SELF_TIME_PREFIX + name[len("timing_s/"):]
        total = self.column(name)
        if own not in self.values:
            return total
        return [t if math.isnan(o) else o for o, t in zip(self.column(own), total)]

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """(steps, values) where ``name`` was logged with a finite value."""
        pairs = [(s, v) for s, v in zip(self.steps, self.column(name)) if not math.isnan(v)]
        return [p[0] for p in pairs], [p[1] for p in pairs]


def validation_reward_keys(names: list[str]) -> list[str]:
    """Validation reward metrics (``val-core/``, ``val-aux/`` or ``val/`` keys naming a reward or score),
    means first, the core section's before the others."""
    val = [n for n in names if n.startswith(("val-core/", "val-aux/", "val/")) and ("reward" in n or "score" in n)
           and "/std@" not in n]
    return sorted(val, key=lambda n: ("mean" not in n, not n.startswith("val-core/"), n))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save_png(plt: Any, fig: Any, path: Path) -> None:
    """Write `fig` to a temporary file beside `path`, then rename: a failed write (a full disk)
    leaves no empty or truncated PNG, only the previous complete one if there was one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _integer_locator() -> Any:
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _line_plot(
    table: MetricTable,
    path: Path,
    title: str,
    ylabel: str,
    keys: list[str],
    band: Optional[tuple[str, str]] = None,
) -> bool:
    """One curve per key that was logged (a min–max band if given); False when nothing to draw."""
    keys = [k for k in keys if table.series(k)[0]]
    if not keys:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for key in keys:
        steps, vals = table.series(key)
        marker = "o" if len(steps) <= 30 or key.startswith("val") else None
        if len(steps) > SMOOTH_FROM and not key.startswith("val"):
            # Noisy per-step curves: the raw values faint, a trailing moving average on top.
            window = max(3, len(steps) // 20)
            (raw,) = ax.plot(steps, vals, alpha=0.3, linewidth=1.0)
            ax.plot(steps, _moving_average(vals, window), color=raw.get_color(), linewidth=2.0,
                    label=f"{key} (mean of last {window})")
        else:
            ax.plot(steps, vals, label=key, marker=marker, markersize=3 if len(steps) > 1 else 6, linewidth=1.6)
    if band is not None:
        low_s, low = table.series(band[0])
        high_s, high = table.series(band[1])
        if low_s and low_s == high_s:
            label = f"{band[0].rsplit('/', 1)[-1]}–{band[1].rsplit('/', 1)[-1]}"
            ax.fill_between(low_s, low, high, alpha=0.15, label=label)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(_integer_locator())
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    _save_png(plt, fig, path)
    return True


def plot_reward(table: MetricTable, path: Path) -> bool:
    keys = ["critic/score/mean"] + validation_reward_keys(table.names)[:MAX_VAL_CURVES]
    return _line_plot(table, path, "Reward", "reward", keys)


def plot_reward_model(table: MetricTable, path: Path) -> bool:
    """The reward model's score of each step's responses: mean, with the min–max band."""
    return _line_plot(table, path, "Reward-model score", "score", [RM_SCORE_KEY],
                      band=("reward_model/score/min", "reward_model/score/max"))


def plot_response_length(table: MetricTable, path: Path) -> bool:
    return _line_plot(
        table, path, "Response length", "tokens", ["response_length/mean"],
        band=("response_length/min", "response_length/max"),
    )


def plot_kl(table: MetricTable, path: Path) -> bool:
    return _line_plot(table, path, "KL", "KL", list(KL_KEYS))


def plot_entropy(table: MetricTable, path: Path) -> bool:
    return _line_plot(table, path, "Policy entropy", "nats per token", ["actor/entropy"])


def plot_throughput(table: MetricTable, path: Path) -> bool:
    return _line_plot(table, path, "Throughput", "tokens/s per device", ["perf/throughput"])


def plot_memory(table: MetricTable, path: Path) -> bool:
    """Peak memory of the workers in each phase (device memory with CUDA, else resident set)."""
    device = sorted(n for n in table.names if n.startswith("memory/") and n.endswith("/max_allocated_gb"))
    keys = device or sorted(n for n in table.names if n.startswith("memory/") and n.endswith("/peak_rss_gb"))
    what = "device memory allocated" if device else "resident set"
    return _line_plot(table, path, f"Peak {what} per phase (largest worker)", "GiB", keys)


def plot_timing(table: MetricTable, path: Path) -> bool:
    """Seconds per phase per step, stacked (the largest phases; the rest summed as "other")."""
    phases = [n for n in table.names if n.startswith("timing_s/") and n != "timing_s/step"
              and n[len("timing_s/"):] not in OUTSIDE_STEP_PHASES]
    if not phases:
        return False
    totals = {p: math.fsum(v for v in table.phase_seconds(p) if not math.isnan(v)) for p in phases}
    ordered = sorted(phases, key=lambda p: -totals[p])
    shown, rest = ordered[:MAX_PHASES], ordered[MAX_PHASES:]
    def seconds(phase: str) -> list[float]:
        return [0.0 if math.isnan(v) else v for v in table.phase_seconds(phase)]

    rows = [seconds(p) for p in shown]
    labels = [f"{p[len('timing_s/'):]} ({100 * totals[p] / (sum(totals.values()) or 1):.0f}%)" for p in shown]
    if rest:
        rows.append([sum(col) for col in zip(*(seconds(p) for p in rest))])
        labels.append("other")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    colors = plt.get_cmap("tab20").colors
    if len(table.steps) <= 60:
        bottom = [0.0] * len(table.steps)
        for i, (row, label) in enumerate(zip(rows, labels)):
            ax.bar(table.steps, row, bottom=bottom, label=label, color=colors[i % len(colors)], width=0.8)
            bottom = [b + r for b, r in zip(bottom, row)]
    else:
        ax.stackplot(table.steps, rows, labels=labels, colors=colors[: len(rows)])
    ax.set_title("Time per phase (share of total in legend)")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(_integer_locator())
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3, axis="y")
    handles, names = ax.get_legend_handles_labels()  # reversed: legend top = top of the stack
    ax.legend(handles[::-1], names[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    _save_png(plt, fig, path)
    return True


PLOTS: dict[str, Callable[[MetricTable, Path], bool]] = {
    "reward": plot_reward,
    "reward_model": plot_reward_model,
    "response_length": plot_response_length,
    "kl": plot_kl,
    "throughput": plot_throughput,
    "timing": plot_timing,
    "memory": plot_memory,
    "entropy": plot_entropy,
}


def write_plots(table: MetricTable, out_dir: Path) -> dict[str, Path]:
    """Draw every plot whose metrics exist into ``out_dir/<name>.png``; returns ``{name: path}``."""
    written: dict[str, Path] = {}
    for name, draw in PLOTS.items():
        path = out_dir / f"{name}.png"
        if draw(table, path):
            written[name] = path
    return written
