"""One compact console line per step with the metrics people watch."""

from __future__ import annotations

import math
from collections.abc import Mapping

# (metric, short label) in display order; a metric missing from a step is left out of its line.
CONSOLE_METRICS: tuple[tuple[str, str], ...] = (
    ("critic/score/mean", "score"),
    ("val-core/reward/mean", "val"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/ppo_kl", "ppo_kl"),
    ("actor/kl_loss", "kl_loss"),
    ("actor/entropy", "entropy"),
    ("actor/grad_norm", "grad_norm"),
    ("critic/vf_loss", "vf_loss"),
    ("response_length/mean", "resp_len"),
    ("response_length/clip_ratio", "clip"),
    ("perf/throughput", "tok/s"),
    ("timing_s/step", "step_s"),
)


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    if float(value).is_integer() and abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.4g}"


def format_step_line(step: int, metrics: Mapping[str, float], total_steps: int | None = None) -> str:
    """``step 12/100 | score 0.531 | pg_loss -0.0123 | ...`` for the metrics in ``CONSOLE_METRICS``.

    The validation's core mean (any ``val-core/.../mean@...`` key: accuracy when the scorer reports
    it, else reward) is shown as ``val``.
    """
    head = f"step {step}" + (f"/{total_steps}" if total_steps else "")
    parts = [head]
    for name, label in CONSOLE_METRICS:
        value = metrics.get(name)
        if value is None and label == "val":
            value = next(
                (v for k, v in sorted(metrics.items()) if k.startswith("val-core/") and "/mean@" in k), None
            )
        if value is not None:
            parts.append(f"{label} {_fmt(float(value))}")
    return " | ".join(parts)
