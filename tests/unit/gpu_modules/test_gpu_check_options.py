"""tools/gpu_check.sh's options, checked with a stand-in bundle whose gpu_check.py only exits 0 (no
real bundle is built here): bad numbers and step names are refused before anything runs, relative
paths still work after the steps' cd, a user's --workdir keeps what the check did not put there, a
step without a recorded outcome fails the check; and the Make target passes absolute paths."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tools" / "gpu_check.sh"
STEPS = ["env", "deps", "imports", "ray", "unit", "gpu-tests", "train", "bench"]
ALL_STEPS = ",".join(STEPS)
ALL_BUT_DEPS = ",".join(s for s in STEPS if s != "deps")
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def fake_bundle(tmp_path: Path) -> Path:
    """A bundle archive with the layout the check unpacks (one top folder: MANIFEST.json, src/) whose
    tools/gpu_check.py accepts any sub-command and exits 0."""
    top = tmp_path / "bundle-tree" / "megarl-gpu-bundle-test"
    (top / "src" / "tools").mkdir(parents=True)
    (top / "site").mkdir()
    (top / "MANIFEST.json").write_text(json.dumps({"python": PY_VERSION}))
    (top / "src" / "tools" / "gpu_check.py").write_text("import sys\nprint('stand-in check', sys.argv[1:])\n")
    archive = tmp_path / "bundle.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(top, arcname=top.name)
    return archive


def run_check(args: list[str], cwd: Path, env: dict[str, str] | None = None,
              timeout: int = 120) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)
    print(f"$ gpu_check.sh {shlex.join(args)}\nexit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def summary_status(out: Path) -> dict[str, str]:
    return {s["name"]: s["status"] for s in json.loads((out / "summary.json").read_text())["steps"]}


# ------------------------------------------------------------------------------ numeric options
@pytest.mark.parametrize("flag,value", [("--budget", "600s"), ("--budget", "300.5"), ("--budget", "10m"),
                                        ("--budget", "0"), ("--budget", "-5"), ("--steps", "two"),
                                        ("--steps", "2.5"), ("--probs-diff-tol", "abc")])
def test_a_bad_number_is_refused_before_anything_runs(tmp_path: Path, flag: str, value: str):
    out = tmp_path / "out"
    done = run_check(["--dry-run", "--out", str(out), "--python", sys.executable, "--skip", ALL_STEPS,
                      flag, value], cwd=tmp_path)
    assert done.returncode == 2
    assert flag in done.stderr and value in done.stderr
    assert not (out / "summary.json").exists()


def test_a_value_missing_at_the_end_is_refused(tmp_path: Path):
    done = run_check(["--dry-run", "--out", str(tmp_path / "out"), "--budget"], cwd=tmp_path)
    assert done.returncode == 2 and "--budget" in done.stderr


def test_a_step_that_records_no_outcome_fails_the_check(tmp_path: Path):
    """A step aborted inside the script (here: a `date` that prints no valid number, so the budget
    arithmetic fails before the step is recorded) must not leave the check green."""
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "date").write_text("#!/bin/sh\necho 08\n")  # "08": not a number bash arithmetic accepts
    (fake / "date").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    done = run_check(["--dry-run", "--out", str(tmp_path / "out"), "--python", sys.executable,
                      "--skip", ALL_BUT_DEPS], cwd=tmp_path, env=env)
    assert done.returncode != 0
    assert "RESULT: passed" not in done.stdout


# ------------------------------------------------------------------------------------- --skip
def test_an_unknown_skip_name_is_refused_with_the_valid_names(tmp_path: Path):
    out = tmp_path / "out"
    done = run_check(["--dry-run", "--out", str(out), "--python", sys.executable,
                      "--skip", f"{ALL_STEPS},gpu_tests"], cwd=tmp_path)
    assert done.returncode == 2
    assert "gpu_tests" in done.stderr and all(step in done.stderr for step in STEPS)
    assert not (out / "summary.json").exists()


# ------------------------------------------------------------------------------ relative paths
@pytest.mark.parametrize("relative", ["python", "workdir"])
def test_relative_python_and_workdir_work_after_the_steps_cd(tmp_path: Path, relative: str):
    bundle = fake_bundle(tmp_path)
    here = tmp_path / "here"
    (here / "py").mkdir(parents=True)
    # An interpreter under the current directory, named without "..": such a path can never resolve
    # from another directory by climbing past the root.
    (here / "py" / "python").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    (here / "py" / "python").chmod(0o755)
    python = "py/python" if relative == "python" else sys.executable
    workdir = ["--workdir", "wd"] if relative == "workdir" else []
    out = tmp_path / "out"
    done = run_check([str(bundle), "--dry-run", "--python", python, *workdir, "--out", str(out),
                      "--skip", ALL_BUT_DEPS], cwd=here)
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary_status(out)["deps"] == "passed"


def test_make_passes_absolute_paths_to_the_check():
    done = subprocess.run(["make", "-n", "--no-print-directory", "gpu-bundle-dry-run", f"PYTHON={sys.executable}"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    words = shlex.split(done.stdout.replace("\\\n", " "))
    check = words.index("tools/gpu_check.sh")
    args = words[check + 1:]
    python = args[args.index("--python") + 1]
    assert Path(python).is_absolute(), python
    assert Path(args[0]).is_absolute() and Path(args[args.index("--out") + 1]).is_absolute(), args


# -------------------------------------------------------------------------------- --workdir DIR
def test_a_non_empty_workdir_is_refused_and_left_alone(tmp_path: Path):
    bundle = fake_bundle(tmp_path)
    workdir = tmp_path / "wd"
    workdir.mkdir()
    (workdir / "my_results.txt").write_text("precious")
    done = run_check([str(bundle), "--dry-run", "--python", sys.executable, "--workdir", str(workdir),
                      "--out", str(tmp_path / "out"), "--skip", ALL_STEPS], cwd=tmp_path)
    assert done.returncode == 2 and str(workdir) in done.stderr
    assert sorted(p.name for p in workdir.iterdir()) == ["my_results.txt"]
    assert (workdir / "my_results.txt").read_text() == "precious"


def test_an_existing_empty_workdir_stays_and_is_emptied(tmp_path: Path):
    bundle = fake_bundle(tmp_path)
    workdir = tmp_path / "wd"
    workdir.mkdir()
    done = run_check([str(bundle), "--dry-run", "--python", sys.executable, "--workdir", str(workdir),
                      "--out", str(tmp_path / "out"), "--skip", ALL_BUT_DEPS], cwd=tmp_path)
    assert done.returncode == 0
    assert workdir.is_dir() and list(workdir.iterdir()) == []


def test_results_inside_a_new_workdir_survive(tmp_path: Path):
    bundle = fake_bundle(tmp_path)
    workdir = tmp_path / "wd"
    out = workdir / "results"
    done = run_check([str(bundle), "--dry-run", "--python", sys.executable, "--workdir", str(workdir),
                      "--out", str(out), "--skip", ALL_BUT_DEPS], cwd=tmp_path)
    assert done.returncode == 0
    assert summary_status(out)["deps"] == "passed"
    assert sorted(p.name for p in workdir.iterdir()) == ["results"]


# ----------------------------------------------------------------- the train step's memory check
STUB_CLI = '''"""Stand-in for `megarl` in the bundle: `train` writes metrics.jsonl without perf/colocated_peak_ratio."""
import json, sys
from pathlib import Path

if __name__ == "__main__" and sys.argv[1] == "train":
    overrides = dict(a.split("=", 1) for a in sys.argv[3:])
    run = Path(overrides["trainer.default_local_dir"])
    run.mkdir(parents=True, exist_ok=True)
    steps = int(overrides["trainer.total_training_steps"])
    metrics = {"critic/score/mean": 0.5, "actor/pg_loss": -0.01, "actor/grad_norm": 1.0,
               "sync/bytes_received": 100.0, "sync/bytes_minimum": 100.0,
               "training/rollout_logprob_abs_diff_max": 1e-6}
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "metrics": metrics}) + "\\n"
                                               for s in range(1, steps + 1)))
'''


def test_on_gpu_the_train_step_fails_without_the_colocated_peak_ratio(tmp_path: Path):
    """The GPU mode's train step, with the real check script and a stand-in `megarl` whose run logs
    everything but the colocated peak ratio: the summary says the ratio must be <= 1.1 with CUDA, so
    a run that never reported it must fail that step."""
    top = tmp_path / "bundle-tree" / "megarl-gpu-bundle-test"
    (top / "src" / "tools").mkdir(parents=True)
    (top / "src" / "megarl").mkdir()
    (top / "site").mkdir()
    (top / "MANIFEST.json").write_text(json.dumps({"python": PY_VERSION}))
    for name in ("gpu_check.py", "gpu_bundle.py"):
        (top / "src" / "tools" / name).write_text((REPO / "tools" / name).read_text())
    (top / "src" / "megarl" / "__init__.py").write_text("")
    (top / "src" / "megarl" / "cli.py").write_text(STUB_CLI)
    bundle = tmp_path / "bundle.tar.xz"
    with tarfile.open(bundle, "w:xz") as tar:
        tar.add(top, arcname=top.name)
    out = tmp_path / "out"
    done = run_check([str(bundle), "--python", sys.executable, "--out", str(out), "--steps", "1",
                      "--skip", ",".join(s for s in STEPS if s != "train")], cwd=tmp_path)
    assert done.returncode == 1
    assert summary_status(out)["train"].startswith("FAILED")
    log = (out / "logs" / "train.log").read_text().splitlines()
    assert any(line.startswith("FAIL") and "colocated_peak_ratio" in line for line in log), log[-10:]
