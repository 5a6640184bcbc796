"""Fault scenarios on real `megarl train` runs (tiny model, local Ray cluster, 2 actor workers at TP=2).

Each scenario runs a fault and returns a `FaultOutcome`: was it detected, did the run survive it (the
last complete checkpoint verifies, and a rerun resumes from it when `resume=True`), was any data
lost (a complete checkpoint damaged or gone), and how long the detection took. The tests in this
folder assert on them; `benchmarks/reliability.py` runs them all and tabulates the outcomes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import psutil

from megarl.cluster.reaper import tagged_processes as processes_with_tag
from megarl.trainer.checkpoint_dirs import LATEST_FILE
from megarl.trainer.checkpoint_verify import verify_checkpoint
from test_train_e2e import write_config

FULL_DISK_DRIVER = Path(__file__).with_name("full_disk_driver.py")
TAG_ENV = "MEGARL_FAULT_RUN_TAG"  # marks every process of one run (Ray passes the environment down)
# A driver or worker that does not stop within this many seconds is treated as hung.
HANG_S = 300.0


@dataclass
class FaultOutcome:
    fault: str
    detected: bool
    survived: bool  # the last complete checkpoint verifies (and, when tried, the rerun resumed from it)
    data_lost: str  # "none", or what was lost
    time_to_detect_s: Optional[float]
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_task(out: Path) -> Path:
    """The arithmetic task of the e2e tests (400 train / 32 validation prompts, character tokenizer)."""
    subprocess.run(
        [sys.executable, "-m", "megarl.cli", "data", "make", "arithmetic", "--out", str(out),
         "--tokenizer-out", str(out / "tokenizer"), "--num-operands", "2", "--min-value", "0",
         "--max-value", "4", "--operators", "+", "--train-size", "400", "--val-size", "32"],
        check=True, capture_output=True, text=True,
    )
    return out


def start_train(config: Path, *overrides: str, tag: str = "", script: Optional[list[str]] = None) -> subprocess.Popen:
    """`megarl train CONFIG overrides` (or `script + [CONFIG, overrides]`) in its own session."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **({TAG_ENV: tag} if tag else {}))
    command = script or [sys.executable, "-m", "megarl.cli", "train"]
    return subprocess.Popen([*command, str(config), *overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=config.parent, start_new_session=True)


def run_train(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "megarl.cli", "train", str(config), *overrides],
                          capture_output=True, text=True, timeout=900, env=env, cwd=config.parent)


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return sorted(json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip())


def step_timings(run_dir: Path, step: int) -> dict[str, float]:
    """The `timing_s/<phase>` metrics of `step`, keyed by phase."""
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["step"] == step:
            return {key.removeprefix("timing_s/"): value for key, value in record["metrics"].items()
                    if key.startswith("timing_s/")}
    raise KeyError(f"step {step} not in {run_dir / 'metrics.jsonl'}")


def wait_for(predicate: Any, proc: subprocess.Popen, what: str, timeout_s: float = 900.0, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}:\n{proc.stderr.read()[-5000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def error_lines(stderr: str) -> list[str]:
    """What the CLI printed as its error: from the `error: ` line to the end."""
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    return lines[starts[-1]:] if starts else []


def _log_time(stderr: str, pattern: str) -> Optional[float]:
    """Unix time of the first log line (`%(asctime)s` format, local time) matching `pattern`."""
    for line in stderr.splitlines():
        if re.search(pattern, line):
            stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
            if stamp:
                return datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def checkpoint_state(ckpts: Path) -> tuple[bool, str, Optional[int]]:
    """(last complete checkpoint verifies, its message, its step), and no partial save is taken as one."""
    latest = ckpts / LATEST_FILE
    if not latest.is_file():
        return False, f"{latest} missing", None
    report = verify_checkpoint(ckpts)
    return report.ok, report.message(), int(latest.read_text())


def worker_processes(driver: subprocess.Popen) -> list[psutil.Process]:
    """The driver's worker processes alive now (a child may end between the listing and its name)."""
    found = []
    for proc in psutil.Process(driver.pid).children(recursive=True):
        try:
            if proc.name().startswith("ray::HostWorker"):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return found


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries `tag` (every process of that run: Ray's too)."""
    return processes_with_tag(tag, TAG_ENV)


def describe(proc: psutil.Process) -> tuple[int, str, str]:
    """(pid, name, start of the command line) of a process, for a failure message."""
    try:
        return proc.pid, proc.name(), " ".join(proc.cmdline())[:200]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return proc.pid, "(gone)", ""


def processes_naming(text: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if text in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_worker_during_update(work: Path, task: Path, resume: bool = False) -> FaultOutcome:
    """SIGKILL of an actor worker while the actor update runs (step 2; step 1 was checkpointed).

    The update is made the longest phase by far (`actor.ppo_epochs=100`: ~4 s here, the rest of a
    step ~0.1 s), and the kill is timed from step 1's phases: step 2's phases before the update, then
    40% of its update. The error says which call the rank died in, so a kill outside the update is
    seen, not hidden.
    """
    config = write_config(work, task)
    common = ("trainer.total_training_steps=3", "trainer.save_freq=1", "actor.ppo_epochs=100")
    driver = start_train(config, *common)
    run_dir = work / "run"
    wait_for(lambda: logged_steps(run_dir) == [1], driver, "step 1 was logged")
    timing = step_timings(run_dir, 1)
    before_update = timing["step"] - timing["update_actor"]
    time.sleep(max(before_update + 0.4 * timing["update_actor"], 0.0))
    workers = worker_processes(driver)
    victim = workers[-1]
    killed_at, killed_mono = time.time(), time.monotonic()
    victim.send_signal(signal.SIGKILL)
    _, stderr = driver.communicate(timeout=HANG_S)
    exit_s = time.monotonic() - killed_mono
    failed_at = _log_time(stderr, r"killing all \d+ ranks after a failure")
    message = error_lines(stderr)
    ok, verify_message, step = checkpoint_state(run_dir / "checkpoints")
    steps = logged_steps(run_dir)
    details: dict[str, Any] = {"victim_pid": victim.pid, "exit_code": driver.returncode, "driver_exit_s": exit_s,
                               "error": message, "checkpoint": verify_message, "checkpoint_step": step,
                               "last_logged_step": steps[-1] if steps else None}
    survived = ok and step == 1
    if resume and survived:
        rerun = run_train(config, *common)
        details["resume_exit_code"] = rerun.returncode
        details["resumed_steps"] = logged_steps(run_dir)
        survived = rerun.returncode == 0 and "resuming from" in rerun.stderr and logged_steps(run_dir)[-1] == 3
    detected = driver.returncode == 1 and bool(message) and "died during" in message[0]
    return FaultOutcome("SIGKILL of an actor worker during the update", detected, survived,
                        "none" if ok else "last complete checkpoint does not verify",
                        None if failed_at is None else max(0.0, failed_at - killed_at), details)


def kill_driver_mid_step(work: Path, task: Path, within_s: float = 60.0, group: bool = True) -> FaultOutcome:
    """SIGKILL of the driver's process group (`group`) or of the driver alone during a step: every
    process of the run must be gone (Ray's GCS, raylet, agents, the workers) within `within_s`."""
    config = write_config(work, task)
    tag = f"fault-{os.getpid()}-{time.monotonic_ns()}"
    driver = start_train(config, "trainer.total_training_steps=50", "trainer.save_freq=1", tag=tag)
    run_dir = work / "run"
    wait_for(lambda: len(logged_steps(run_dir)) >= 1, driver, "step 1 was logged")
    before = tagged_processes(tag)
    raylet = [p for p in before if p.name() == "raylet"]
    session = re.search(r"--session_dir=(\S+)", " ".join(raylet[0].cmdline())).group(1) if raylet else ""
    names = sorted({p.name() for p in before})
    killed = time.monotonic()
    if group:
        os.killpg(driver.pid, signal.SIGKILL)
    else:
        os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=60)
    left: list[psutil.Process] = tagged_processes(tag)
    while left and time.monotonic() - killed < within_s:
        time.sleep(0.1)
        left = tagged_processes(tag)
    gone_s = time.monotonic() - killed
    naming = processes_naming(session) if session else []
    ok, verify_message, step = checkpoint_state(run_dir / "checkpoints")
    details = {"processes_before": len(before), "process_names": names, "session_dir": session,
               "left": [describe(p) for p in left], "left_naming_session": [describe(p) for p in naming],
               "checkpoint": verify_message, "checkpoint_step": step}
    what = "the driver's process group" if group else "the driver alone"
    return FaultOutcome(f"SIGKILL of {what} mid-step", bool(raylet) and not left and not naming,
                        ok, "none" if ok else "last complete checkpoint does not verify", gone_s, details)


def disk_full_during_save(work: Path, task: Path, resume: bool = False) -> FaultOutcome:
    """ENOSPC (a stand-in, see full_disk_driver.py) while the checkpoint of step 2 is written."""
    config = write_config(work, task)
    common = ("trainer.total_training_steps=3", "trainer.save_freq=1")
    driver = start_train(config, *common, script=[sys.executable, str(FULL_DISK_DRIVER), "2"])
    _, stderr = driver.communicate(timeout=900)
    stamp = re.search(r"full-disk stand-in: ENOSPC at ([\d.]+)", stderr)
    raised_at = float(stamp.group(1)) if stamp else None
    failed_at = _log_time(stderr, r"removing the partial save")
    ckpts = work / "run" / "checkpoints"
    message = error_lines(stderr)
    ok, verify_message, step = checkpoint_state(ckpts)
    partial = sorted(p.name for p in ckpts.glob(".tmp-*"))
    details: dict[str, Any] = {"exit_code": driver.returncode, "error": message, "partial_left": partial,
                               "checkpoint": verify_message, "checkpoint_step": step}
    survived = ok and step == 1 and not partial
    if resume and survived:
        rerun = run_train(config, *common)
        details["resume_exit_code"] = rerun.returncode
        details["resumed_steps"] = logged_steps(work / "run")
        survived = rerun.returncode == 0 and logged_steps(work / "run")[-1] == 3
    detected = driver.returncode == 1 and bool(message) and message[0].startswith("error: No space left on device")
    elapsed = None if raised_at is None or failed_at is None else max(0.0, failed_at - raised_at)
    return FaultOutcome("no space left on device during a checkpoint save", detected, survived,
                        "none" if ok else "last complete checkpoint does not verify", elapsed, details)


def kill_driver_during_save(work: Path, task: Path, resume: bool = True) -> FaultOutcome:
    """SIGKILL of the driver's process group while the step-2 checkpoint is being written (as in
    test_kill_during_save.py); the next start ignores the partial save and resumes from step 1."""
    config = write_config(work, task)
    common = ("trainer.total_training_steps=2", "trainer.save_freq=1")
    driver = start_train(config, *common)
    ckpts = work / "run" / "checkpoints"
    wait_for(lambda: ckpts.is_dir() and any(p.name.startswith("actor") for p in ckpts.glob(".tmp-step_2-*/*")),
             driver, "the step-2 save began", poll_s=0.005)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait(timeout=60)
    started = time.monotonic()
    ok, verify_message, step = checkpoint_state(ckpts)
    detect_s = time.monotonic() - started
    details: dict[str, Any] = {"checkpoint": verify_message, "checkpoint_step": step,
                               "partial_left_after_kill": sorted(p.name for p in ckpts.glob(".tmp-*"))}
    survived = ok and step == 1
    if resume and survived:
        rerun = run_train(config, *common)
        details["resume_exit_code"] = rerun.returncode
        details["partial_left_after_resume"] = sorted(p.name for p in ckpts.glob(".tmp-*"))
        survived = (rerun.returncode == 0 and f"resuming from {ckpts / 'global_step_1'}" in rerun.stderr
                    and not details["partial_left_after_resume"])
    return FaultOutcome("SIGKILL of the driver while writing a checkpoint", bool(details["partial_left_after_kill"])
                        and step == 1, survived, "none" if ok else "last complete checkpoint does not verify",
                        detect_s, details)


def damaged_shard(checkpoint: Path, work: Path, how: str) -> FaultOutcome:
    """A copy of the trainer checkpoint `checkpoint` with its largest engine shard truncated to half
    (`how="truncated"`) or one byte flipped in its middle (`how="bit-flipped"`), then
    `megarl checkpoint verify` on it."""
    copy = work / checkpoint.name
    shutil.copytree(checkpoint, copy)
    shard = max(copy.rglob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    if how == "truncated":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "checkpoint", "verify", str(copy)],
                          capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - started
    output = proc.stdout + proc.stderr
    named = str(shard.relative_to(copy)) in output or shard.name in output
    detected = proc.returncode != 0 and named  # refused before anything loads it: that is surviving it
    return FaultOutcome(f"{how} engine shard", detected, detected, "none (a copy was damaged; "
                        "the original verifies)" if verify_checkpoint(checkpoint).ok else "original damaged",
                        elapsed, {"shard": str(shard.relative_to(copy)), "exit_code": proc.returncode,
                                  "output": [line for line in output.splitlines() if "warn" not in line.lower()][-6:]})
