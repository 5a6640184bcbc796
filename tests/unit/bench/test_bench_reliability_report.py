"""benchmarks/report.py's Reliability section: the outcomes of benchmarks/reliability.py as a table,
and their one-line headline in the component table."""

from __future__ import annotations

import pytest
from report import render_report  # benchmarks/ is on the path (tests/unit/bench/conftest.py)

pytestmark = pytest.mark.unit


def _bench() -> dict:
    outcomes = [
        {"fault": "SIGKILL of an actor worker during the update", "detected": True, "survived": True,
         "data_lost": "none", "time_to_detect_s": 0.081, "details": {"resume_exit_code": 0}},
        {"fault": "no space left on device during a checkpoint save", "detected": True, "survived": False,
         "data_lost": "last complete checkpoint does not verify", "time_to_detect_s": None, "details": {}},
        {"fault": "truncated engine shard", "error": "AssertionError: the run exited (1) before step 1"},
        {"fault": "bit-flipped engine shard", "detected": True, "survived": True,
         "data_lost": "none (a copy was damaged; the original verifies)", "time_to_detect_s": 9.0, "details": {}},
    ]
    reliability = {"status": "ok", "seconds": 300.0, "load_average_before": [1.0, 1.0, 1.0],
                   "result": {"benchmark": "reliability", "outcomes": outcomes}}
    components = {"components": {"reliability": reliability}}
    return {"machine": {}, "sections": {"components": {"status": "ok", "result": components}}}


def test_reliability_outcomes_become_a_section_and_a_headline():
    md = render_report(_bench())
    assert "| reliability | ok | 300 | 1.0 / 1.0 / 1.0 | - | 3/4 faults detected, 2 survived, data lost in 1 |" in md
    section = md.split("## Reliability: injected faults (benchmarks/reliability.py)", 1)[1].strip().splitlines()
    assert section[0] == "| fault | detected | survived / resumed | data lost | time to detect (s) |"
    assert section[2] == "| SIGKILL of an actor worker during the update | yes | yes (rerun resumed) | none | 0.081 |"
    assert section[3] == ("| no space left on device during a checkpoint save | yes | no | "
                          "last complete checkpoint does not verify | - |")
    assert section[4].startswith("| truncated engine shard | scenario failed: AssertionError: the run exited (1)")


def test_no_reliability_section_without_its_result():
    bench = _bench()
    bench["sections"]["components"]["result"]["components"]["reliability"] = {"status": "failed", "error": "boom"}
    assert "## Reliability" not in render_report(bench)
