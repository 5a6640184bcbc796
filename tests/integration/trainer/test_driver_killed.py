"""SIGKILL of the driver mid-step, of its process group or of the driver's PID alone, leaves no
process of the run behind: not Ray's GCS, raylet, dashboard/runtime-env agents or log monitor, not
the workers (which Ray starts in process groups of their own), not a worker raylet was starting."""

from __future__ import annotations

from pathlib import Path

import pytest

from fault_scenarios import kill_driver_mid_step
from test_train_e2e import task_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

WITHIN_S = 60.0


# The driver's PID alone (nothing but the reaper stops the cluster) runs in `make test`; the whole
# process group with `make test-slow`.
@pytest.mark.parametrize("group", [pytest.param(True, marks=pytest.mark.slow), False], ids=["process_group", "driver_pid"])
def test_killed_driver_leaves_no_ray_process(tmp_path: Path, task_dir: Path, group: bool) -> None:  # noqa: F811
    outcome = kill_driver_mid_step(tmp_path, task_dir, within_s=WITHIN_S, group=group)
    details = outcome.details
    print(f"all {details['processes_before']} processes of the run gone {outcome.time_to_detect_s:.1f} s "
          "after the kill")
    # The run really had a local Ray cluster and workers to leave behind.
    assert {"raylet", "gcs_server"} <= set(details["process_names"]), details["process_names"]
    assert any(name.startswith("ray::HostWorker") for name in details["process_names"])
    assert details["session_dir"]
    assert details["left"] == [], f"still running {WITHIN_S} s after the kill: {details['left']}"
    assert details["left_naming_session"] == [], details["left_naming_session"]
    assert outcome.survived, details["checkpoint"]
