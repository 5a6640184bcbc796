"""Committed benchmark results and reports name no folder of the machine that measured them (paths
inside the repository are written relative to it; a run's output folder is left out)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:tmp|home|work|root|Users|scratch)/[\w.+-]")


def test_results_files_carry_no_absolute_machine_paths() -> None:
    files = sorted(p for p in RESULTS.rglob("*") if p.suffix in (".json", ".jsonl", ".md", ".txt", ".log"))
    assert files, f"no results under {RESULTS}"
    found = []
    for path in files:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            match = MACHINE_PATH.search(line)
            if match:
                found.append(f"{path.relative_to(RESULTS)}:{number}: ...{line[max(0, match.start() - 30):match.end() + 30]}...")
    assert not found, "\n".join(found[:10])
