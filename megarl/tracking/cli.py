"""``megarl report RUN_DIR``: write the plots and summary of a run (finished or still running)."""

from __future__ import annotations

import argparse
from typing import Any

from megarl.argtypes import positive_int


def register_cli(subparsers: Any) -> None:
    """Add the ``report`` subcommand to the ``megarl`` argument parser."""
    parser = subparsers.add_parser(
        "report",
        help="write the report (plots and summary) of a run directory",
        description="Read RUN_DIR/metrics.jsonl and write PNG plots and summary.md to RUN_DIR/report/.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds metrics.jsonl)")
    parser.add_argument("--k", type=positive_int("number of steps"), default=None,
                        help="steps averaged at each end for first/last reward (default: half the steps, at most 10)")
    parser.add_argument("--quiet", action="store_true", help="do not print the summary")
    parser.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    from megarl.tracking.report import write_report

    paths = write_report(args.run_dir, k=args.k)
    if not args.quiet:
        print(paths["summary"].read_text(encoding="utf-8"), end="")
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0
