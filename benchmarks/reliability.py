"""Reliability under injected faults: each fault scenario of tests/integration/trainer/fault_scenarios.py
run once on a real `megarl train` run (tiny Qwen2, local Ray cluster, 2 actor workers at TP=2, CPU).

Faults: SIGKILL of an actor worker during the update; SIGKILL of the driver's process group mid-step
and of the driver's PID alone (every process of the run must be gone), and of the group while a
checkpoint is written; no space left on device
during a save (a stand-in: the driver's write into the temporary checkpoint raises ENOSPC); an engine
shard truncated and one with a flipped bit (`megarl checkpoint verify` on a damaged copy).

For each: detected (yes/no), survived (the last complete checkpoint verifies; with --resume, a rerun
of the same command resumed from it and finished), data lost (a complete checkpoint damaged or
gone; "none" expected), time to detect in seconds (worker kill: kill -> the driver's failure log
line; driver kill: kill -> no process of the run left; full disk: the ENOSPC -> the partial save
removed; kill during a save: the verification of the remaining checkpoints at the next start;
damaged shard: one `megarl checkpoint verify` process, start-up included).

    python benchmarks/reliability.py [--no-resume] [--out benchmarks/results/reliability.json]

Writes the JSON and a markdown table beside it (same name, .md).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "integration" / "trainer"))  # the scenarios live beside their tests

from common import RESULTS_DIR, load_average, machine_info, write_json  # noqa: E402
from fault_scenarios import (  # noqa: E402
    FaultOutcome,
    damaged_shard,
    disk_full_during_save,
    kill_driver_during_save,
    kill_driver_mid_step,
    kill_worker_during_update,
    make_task,
)

DEFAULT_OUT = RESULTS_DIR / "reliability.json"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def markdown(outcomes: list[dict[str, Any]]) -> str:
    """The table of outcomes (also what benchmarks/report.py prints in its Reliability section)."""
    lines = ["| fault | detected | survived / resumed | data lost | time to detect (s) |", "|---|---|---|---|---|"]
    for o in outcomes:
        if "error" in o:
            lines.append(f"| {o['fault']} | scenario failed: {o['error'][:200]} | - | - | - |")
            continue
        seconds = "-" if o["time_to_detect_s"] is None else f"{o['time_to_detect_s']:.2f}"
        resumed = o["details"].get("resume_exit_code")
        rerun = "" if resumed is None else (" (resumed)" if o["survived"] else " (resume failed)")
        survived = _yes(o["survived"]) + rerun
        lines.append(f"| {o['fault']} | {_yes(o['detected'])} | {survived} | {o['data_lost']} | {seconds} |")
    return "\n".join(lines) + "\n"


def run(work: Path, resume: bool) -> list[dict[str, Any]]:
    task = make_task(work / "task")
    outcomes: list[dict[str, Any]] = []

    def attempt(name: str, scenario: Callable[[Path], FaultOutcome]) -> FaultOutcome | None:
        folder = work / name
        folder.mkdir()
        started = time.monotonic()
        try:
            outcome = scenario(folder)
        except Exception as err:  # one scenario's breakage must not hide the others' outcomes
            outcomes.append({"fault": name, "error": f"{type(err).__name__}: {err}"})
            print(f"{name}: scenario failed: {err}", flush=True)
            return None
        record = {**outcome.as_dict(), "scenario_wall_s": round(time.monotonic() - started, 1)}
        outcomes.append(record)
        print(f"{name}: detected={outcome.detected} survived={outcome.survived} lost={outcome.data_lost} "
              f"detect_s={outcome.time_to_detect_s}", flush=True)
        return outcome

    attempt("worker_kill", lambda d: kill_worker_during_update(d, task, resume=resume))
    attempt("driver_kill", lambda d: kill_driver_mid_step(d, task))
    attempt("driver_pid_kill", lambda d: kill_driver_mid_step(d, task, group=False))
    attempt("disk_full", lambda d: disk_full_during_save(d, task, resume=resume))
    attempt("kill_during_save", lambda d: kill_driver_during_save(d, task, resume=resume))
    source = work / "kill_during_save" / "run" / "checkpoints" / "global_step_1"
    for how in ("truncated", "bit-flipped"):
        if source.is_dir():
            attempt(f"shard_{how}", lambda d, how=how: damaged_shard(source, d, how))
        else:
            outcomes.append({"fault": f"{how} engine shard", "error": f"no checkpoint to damage ({source} missing)"})
    return outcomes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-resume", action="store_true", help="skip the reruns that resume after a fault")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="megarl_reliability_"))
    started = time.monotonic()
    load_before = load_average()
    try:
        outcomes = run(work, resume=not args.no_resume)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # The results name neither this machine's temporary folders nor its host name.
    text = json.dumps(outcomes).replace(str(work), "<work>").replace(socket.gethostname(), "<host>")
    text = re.sub(r"/[^\"\s]*/session_[\w.-]+", "<ray session dir>", text)
    outcomes = json.loads(text)
    payload = {"benchmark": "reliability", "machine": machine_info(), "load_average_before": load_before,
               "load_average_after": load_average(), "resume": not args.no_resume,
               "wall_s": round(time.monotonic() - started, 1), "outcomes": outcomes}
    write_json(args.out, payload)
    table = markdown(outcomes)
    note = (f"Tiny Qwen2, local Ray cluster, 2 actor workers at TP=2 on {payload['machine'].get('cpu_count', '-')} "
            f"CPUs; load average before {load_before}; all scenarios {payload['wall_s']} s"
            f"{' including the resumed reruns' if payload['resume'] else ''}. "
            "Generated by benchmarks/reliability.py.\n\n")
    args.out.with_suffix(".md").write_text("# Reliability under injected faults\n\n" + note + table)
    print(table)
    return 0 if outcomes and all("error" not in o for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
