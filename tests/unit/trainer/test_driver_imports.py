"""The driver of `megarl train` does not import Megatron-Core: only the worker processes build
engines. `megarl.trainer.cli` and every module its `train` imports are imported in a fresh
interpreter here (the list is read from `train`'s source, so a new import is covered); a
module-level import of the engine anywhere on that path (the role classes, the checkpoint checks
before a resume) costs every run seconds of start-up and fails this test."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys

import pytest

from megarl.trainer import cli

pytestmark = pytest.mark.unit

PROBE = """
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
print("PROBE " + json.dumps(sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))))
"""


def driver_modules() -> list[str]:
    tree = ast.parse(inspect.getsource(cli.train))
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    return ["megarl.trainer.cli", *imported]


def test_the_driver_modules_do_not_import_megatron_core() -> None:
    modules = driver_modules()
    assert {"megarl.trainer.workers", "megarl.trainer.loop", "megarl.trainer.setup"} <= set(modules), modules
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE.format(modules=modules)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))
    assert json.loads(line[len("PROBE "):]) == []
