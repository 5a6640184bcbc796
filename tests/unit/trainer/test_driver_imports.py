"""The driver of `megarl train` does not import Megatron-Core: only the worker processes build
engines. Every module `megarl.trainer.cli.train` imports is imported in a fresh interpreter here; a
module-level import of the engine anywhere on that path (the role classes, the checkpoint checks
before a resume) costs every run seconds of start-up and fails this test."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

DRIVER_MODULES = ("megarl.trainer.cli", "megarl.cluster.ray_cluster", "megarl.trainer.loop", "megarl.trainer.run_spec",
                  "megarl.trainer.setup", "megarl.trainer.workers", "megarl.tracking.progress",
                  "megarl.tracking.report", "megarl.tracking.tracker")
PROBE = """
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
print("PROBE " + json.dumps(sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))))
"""


def test_the_driver_modules_do_not_import_megatron_core() -> None:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE.format(modules=DRIVER_MODULES)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))
    assert json.loads(line[len("PROBE "):]) == []
