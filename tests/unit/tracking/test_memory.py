"""Per-phase memory of a worker process: the resident-set peak resets between phases."""

from __future__ import annotations

import pytest

from megarl.tracking.memory import GIB, colocated_peak_ratio, memory_stats, phase_metrics, reset_peaks, step_metrics

pytestmark = pytest.mark.unit


def test_peak_resident_set_covers_a_phase_and_resets() -> None:
    reset_peaks()
    base = memory_stats()["rss_gb"]
    block = bytearray(256 * 2**20)  # touched: 256 MiB resident during this "phase"
    for i in range(0, len(block), 4096):
        block[i] = 1
    del block
    during = memory_stats()  # reads the peak of the phase, then resets it
    assert during["peak_rss_gb"] - base > 0.9 * 256 * 2**20 / GIB
    after = memory_stats()
    assert after["peak_rss_gb"] < during["peak_rss_gb"] - 0.5 * 256 * 2**20 / GIB  # the next phase starts low


def test_phase_and_step_metrics_take_the_largest_rank() -> None:
    per_rank = [{"peak_rss_gb": 1.0, "rss_gb": 0.5}, {"peak_rss_gb": 3.0, "rss_gb": 0.25}]
    phases = phase_metrics("gen", per_rank)
    assert phases == {"memory/gen/peak_rss_gb": 3.0, "memory/gen/rss_gb": 0.5}
    phases.update(phase_metrics("update_actor", [{"peak_rss_gb": 4.0, "max_allocated_gb": 2.0, "max_reserved_gb": 2.5}]))
    assert step_metrics(phases) == {"perf/cpu_memory_used_gb": 4.0, "perf/max_memory_allocated_gb": 2.0,
                                    "perf/max_memory_reserved_gb": 2.5}


def test_colocated_peak_ratio_sees_training_and_rollout_overlap() -> None:
    """Hand-worked: update 6 GiB, generation 5 GiB. A sync holding the actor's parameters (1 GiB)
    and the rollout's weights (1 GiB) stays under both: ratio 1. A sync that onloads the whole
    training state (6 GiB) next to the rollout's weights (1 GiB) and buffers (0.6 GiB): 7.6 / 6."""
    def phases(**peaks: float) -> dict[str, float]:
        return {f"memory/{name}/max_allocated_gb": gib for name, gib in peaks.items()}

    assert colocated_peak_ratio(phases(sync_weights=2.0, gen=5.0, old_log_prob=1.5, update_actor=6.0)) == 1.0
    assert colocated_peak_ratio(phases(sync_weights=7.6, gen=5.0, update_actor=6.0)) == pytest.approx(7.6 / 6.0)
    assert step_metrics(phases(sync_weights=7.6, gen=5.0, update_actor=6.0))["perf/colocated_peak_ratio"] == \
        pytest.approx(7.6 / 6.0)
    # Without device statistics (CPU) or without a generation phase there is no ratio.
    assert colocated_peak_ratio({"memory/gen/peak_rss_gb": 1.0, "memory/update_actor/peak_rss_gb": 2.0}) is None
    assert colocated_peak_ratio(phases(update_actor=6.0)) is None
    assert "perf/colocated_peak_ratio" not in step_metrics({"memory/gen/peak_rss_gb": 1.0})
