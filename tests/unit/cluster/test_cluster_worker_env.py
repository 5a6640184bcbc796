"""The environment a worker group's processes start with (`megarl.cluster.worker_group.worker_env`)."""

from __future__ import annotations

import pytest

from megarl.cluster.worker_group import HUGE_PAGES_ENV, worker_env


def test_cpu_workers_get_their_threads_and_huge_page_allocation(monkeypatch):
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    assert worker_env("cpu", 2.0, {}) == {"OMP_NUM_THREADS": "2", HUGE_PAGES_ENV: "1"}
    assert worker_env("cpu", 0.5, {}) == {"OMP_NUM_THREADS": "1", HUGE_PAGES_ENV: "1"}  # at least one thread


def test_gpu_workers_keep_torch_default_allocation(monkeypatch):
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    assert worker_env("cuda", 4.0, {}) == {"OMP_NUM_THREADS": "4"}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("value", ["0", "1"])
def test_the_drivers_own_setting_is_forwarded(monkeypatch, device, value):
    # Workers on other nodes do not inherit the driver's environment: the value goes to them explicitly.
    monkeypatch.setenv(HUGE_PAGES_ENV, value)
    assert worker_env(device, 1.0, {})[HUGE_PAGES_ENV] == value


def test_the_callers_env_wins(monkeypatch):
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    env = worker_env("cpu", 1.0, {"OMP_NUM_THREADS": "3", HUGE_PAGES_ENV: "0", "EXTRA": "x"})
    assert env == {"OMP_NUM_THREADS": "3", HUGE_PAGES_ENV: "0", "EXTRA": "x"}
