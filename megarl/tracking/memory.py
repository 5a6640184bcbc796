"""Memory of one worker process: resident set and (with CUDA) device memory, with peaks that can be
reset, so the driver can report the peak of each phase.

The resident-set peak since the last reset is Linux's VmHWM, reset by writing 5 to
/proc/self/clear_refs; elsewhere the peak is the current resident set. Units: GiB.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

GIB = 2**30
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _peak_rss_bytes() -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return psutil.Process().memory_info().rss


def memory_stats(reset: bool = True) -> dict[str, float]:
    """`rss_gb` now, `peak_rss_gb` since the last reset; with CUDA `allocated_gb`, `reserved_gb`,
    `max_allocated_gb`, `max_reserved_gb` (peaks since the last reset). Resets the peaks after reading."""
    out = {"rss_gb": psutil.Process().memory_info().rss / GIB, "peak_rss_gb": _peak_rss_bytes() / GIB}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out.update(allocated_gb=torch.cuda.memory_allocated() / GIB, reserved_gb=torch.cuda.memory_reserved() / GIB,
                   max_allocated_gb=torch.cuda.max_memory_allocated() / GIB,
                   max_reserved_gb=torch.cuda.max_memory_reserved() / GIB)
    if reset:
        reset_peaks()
    return out


def reset_peaks() -> None:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        pass  # not Linux, or not allowed: the peak is then the lifetime peak
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def phase_metrics(phase: str, per_rank: list[dict[str, float]]) -> dict[str, float]:
    """`memory/<phase>/<stat>`: the largest value over ranks of each stat."""
    keys = sorted({k for stats in per_rank for k in stats})
    return {f"memory/{phase}/{k}": max(stats.get(k, 0.0) for stats in per_rank) for k in keys}


# The phases that compute with the training state, and the one that generates (loop.py's names).
TRAINING_PHASES = ("old_log_prob", "ref", "values", "update_critic", "update_actor")
ROLLOUT_PHASES = ("gen",)


def colocated_peak_ratio(phases: dict[str, float], stat: str = "max_allocated_gb") -> float | None:
    """The step's peak of `stat` over the larger of its training-phase and rollout-phase peaks.

    Near 1 when training and rollout really take turns on the device: the transitions between them
    (the weight sync, when both the actor's parameters and the rollout's weights are there) stay
    under the larger phase. Above 1 by a rollout weight copy or a training state when they overlap.
    None without the stat (no CUDA) or without both kinds of phase."""
    def peak(names: tuple[str, ...] | None) -> float | None:
        values = [v for k, v in phases.items() if k.endswith(f"/{stat}")
                  and (names is None or k.split("/")[1] in names)]
        return max(values) if values else None

    step, train, rollout = peak(None), peak(TRAINING_PHASES), peak(ROLLOUT_PHASES)
    if step is None or train is None or rollout is None or max(train, rollout) <= 0:
        return None
    return step / max(train, rollout)


def step_metrics(phases: dict[str, float]) -> dict[str, float]:
    """verl's per-step names from the per-phase metrics: the step's peaks over its phases; with CUDA
    also `perf/colocated_peak_ratio` (see `colocated_peak_ratio`)."""
    def peak(stat: str) -> float | None:
        values = [v for k, v in phases.items() if k.endswith(f"/{stat}")]
        return max(values) if values else None

    out = {}
    for name, stat in (("perf/max_memory_allocated_gb", "max_allocated_gb"),
                       ("perf/max_memory_reserved_gb", "max_reserved_gb"),
                       ("perf/cpu_memory_used_gb", "peak_rss_gb")):
        value = peak(stat)
        if value is not None:
            out[name] = value
    ratio = colocated_peak_ratio(phases)
    if ratio is not None:
        out["perf/colocated_peak_ratio"] = ratio
    return out
