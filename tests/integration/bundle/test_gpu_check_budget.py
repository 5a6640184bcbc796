"""tools/gpu_check.sh keeps to its --budget even when a step ignores its stop signal: `timeout -k`
kills such a step some seconds after the TERM, and that grace must fit inside the budget. A stand-in
bundle (no real bundle is built) whose check ignores SIGTERM and sleeps; about half a minute."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[3]
STEPS = ["env", "deps", "imports", "ray", "unit", "gpu-tests", "train", "bench"]
BUDGET_S = 31  # the smallest budget that still runs a step once the kill grace is kept free
SLACK_S = 5    # unpacking, the summary, process start-up


def hanging_bundle(tmp_path: Path) -> Path:
    top = tmp_path / "tree" / "megarl-gpu-bundle-test"
    (top / "src" / "tools").mkdir(parents=True)
    (top / "MANIFEST.json").write_text(json.dumps({"python": f"{sys.version_info.major}.{sys.version_info.minor}"}))
    (top / "src" / "tools" / "gpu_check.py").write_text(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(300)\n")
    archive = tmp_path / "bundle.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(top, arcname=top.name)
    return archive


def test_a_step_that_ignores_its_stop_signal_still_ends_inside_the_budget(tmp_path: Path):
    out = tmp_path / "out"
    start = time.monotonic()
    done = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), str(hanging_bundle(tmp_path)), "--dry-run",
                           "--python", sys.executable, "--out", str(out), "--budget", str(BUDGET_S),
                           "--skip", ",".join(s for s in STEPS if s != "deps")],
                          capture_output=True, text=True, timeout=200)
    elapsed = time.monotonic() - start
    print(done.stdout[-3000:], done.stderr[-3000:], f"{elapsed:.1f} s", sep="\n")
    status = {s["name"]: s["status"] for s in json.loads((out / "summary.json").read_text())["steps"]}
    assert done.returncode == 1 and status["deps"].startswith("FAILED")
    assert elapsed <= BUDGET_S + SLACK_S, f"{elapsed:.1f} s for a {BUDGET_S} s budget"
