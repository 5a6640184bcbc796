"""`megarl bench`: run the benchmarks of a source checkout and write JSON + a markdown report.

The benchmarks live in the repository's ``benchmarks/`` folder (they are not part of the installed
package); the command finds that folder next to the package and runs ``benchmarks/run_all.py`` in
this process. The options are defined here, once, and ``run_all.py`` uses them too.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from megarl.errors import MegarlError

# Benchmark sections, in the order they run by default (each is benchmarks/<name>.py).
SECTIONS = ("e2e", "e2e_25m", "phases", "scaling", "components", "async_modes", "gpu")


def benchmarks_dir() -> Path:
    """The checkout's ``benchmarks/`` folder (MegarlError when megarl is not run from a checkout)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks"
    if not (path / "run_all.py").is_file():
        raise MegarlError(
            f"megarl bench: {path / 'run_all.py'} not found; the benchmarks run from a source checkout "
            "(pip install -e .), not from an installed wheel"
        )
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``megarl bench`` and ``python benchmarks/run_all.py``."""
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {','.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="small smoke sizes (a few minutes; for checking that everything runs)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where bench.json and REPORT.md go (default: benchmarks/results)")
    parser.add_argument("--components", default=None,
                        help="with the components section: only these (comma-separated, e.g. plan_scale,local_modules); "
                             "the earlier run's other components stay in bench.json")
    parser.add_argument("--fresh", action="store_true", help="drop sections of earlier runs from bench.json")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per section (default: per-section)")
    parser.add_argument("--e2e-steps", type=int, default=None,
                        help="steps of the end-to-end comparison (default 120; 3 with --quick, which ignores this)")
    parser.add_argument("--e2e-rounds", type=int, default=None,
                        help="times the end-to-end pair runs in turn (megarl, TRL, megarl, ...), reported as the "
                             "median and range of the ratios (default 3; 1 with --quick)")


def _load_run_all() -> ModuleType:
    folder = benchmarks_dir()
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))  # run_all imports its sibling modules by name
    spec = importlib.util.spec_from_file_location("megarl_benchmarks_run_all", folder / "run_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_command(args: argparse.Namespace) -> int:
    return int(_load_run_all().main_from_args(args))


def register_cli(subparsers: Any) -> None:
    """Add ``megarl bench`` (options: see `add_arguments`)."""
    parser = subparsers.add_parser(
        "bench",
        help="run the benchmarks and write JSON + markdown",
        description="Run the benchmark sections (e2e vs TRL, phases, scaling, components, gpu), each in its own "
        "process, and write bench.json and REPORT.md. Example: megarl bench --sections phases,scaling --quick",
    )
    add_arguments(parser)
    parser.set_defaults(func=_bench_command)
