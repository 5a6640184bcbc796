"""SIGKILL of an actor worker during the update: the driver stops soon with a short error naming
role, rank, node (IP and host name) and the call the rank died in; the last checkpoint verifies."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from fault_scenarios import kill_worker_during_update
from test_train_e2e import task_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration


def test_killed_worker_fails_the_driver_with_a_named_error(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    outcome = kill_worker_during_update(tmp_path, task_dir)
    details = outcome.details
    print(f"driver failed {outcome.time_to_detect_s} s after the kill, exited after {details['driver_exit_s']:.1f} s")
    print("\n".join(details["error"]))
    assert details["exit_code"] == 1, details
    error = details["error"]
    first = error[0]
    assert first.startswith("error: hybrid_actor rank "), error
    assert f"pid {details['victim_pid']}" in first  # the rank it names is the process that was killed
    assert f"host {socket.gethostname()}" in first and " on node " in first
    # The kill is aimed at the update (the longest phase by far); on a loaded machine it can land in
    # the step's next call instead. Whichever it was, the error names it.
    assert re.search(r"died during actor\.(update_actor|save_checkpoint)\(\): "
                     r"its process exited unexpectedly", first), first
    # Ray's own multi-line text (actor id, namespace, a paragraph of possible causes) is not repeated.
    assert len(error) <= 4, error
    assert not any("Some common causes" in line or "actor_id" in line for line in error), error
    assert outcome.detected and outcome.time_to_detect_s is not None
    assert details["driver_exit_s"] < 180, "the driver did not stop after a worker died"  # a hang guard
    # Nothing logged is lost: a step is saved before it is logged (save_freq=1).
    assert details["checkpoint_step"] == details["last_logged_step"], details
    assert details["checkpoint_step"] == 1 and outcome.survived, details["checkpoint"]
