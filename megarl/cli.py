"""The `megarl` command line: train, config, data, convert, checkpoint, sync, bench, report.

Each subsystem adds its own subcommands through a ``register_cli(subparsers)`` function in its own
module; this file only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Optional, Sequence

from megarl.errors import MegarlError

EPILOG = """examples:
  megarl data make arithmetic --out data/arithmetic --tokenizer-out data/arithmetic/tokenizer
  megarl config validate configs/quickstart_cpu.yaml rollout.n=8
  megarl config show configs/quickstart_cpu.yaml actor.optim.lr=1e-5
  megarl train configs/quickstart_cpu.yaml trainer.total_training_steps=20
  megarl checkpoint verify runs/exp/checkpoints
  megarl sync plan config.json --train tp=8,pp=4,dp=2 --rollout-tp 8
"""

# Subsystems that contribute subcommands: (command, module, help line shown while the module is missing).
_PLUGINS: list[tuple[str, str, str]] = [
    ("train", "megarl.trainer.cli", "run an experiment (PPO, GRPO, DAPO, ...) from a YAML config"),
    ("data", "megarl.data.cli", "make synthetic datasets, inspect parquet files"),
    ("convert", "megarl.convert.cli", "convert checkpoints between HF and Megatron formats"),
    ("checkpoint", "megarl.trainer.checkpoint_cli", "verify that a checkpoint is complete"),
    ("sync", "megarl.hybrid.plan_cli", "plan a weight sync between layouts without weights"),
    ("report", "megarl.tracking.cli", "write the report (plots and summary) of a run directory"),
    ("bench", "megarl.bench", "run the benchmarks and write JSON + markdown"),
]


def _add_config_commands(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("config", help="show or validate an experiment config")
    sub = parser.add_subparsers(dest="config_command", required=True, metavar="{show,validate,keys}")
    for name, helptext in (
        ("show", "print the resolved config (bases merged, overrides applied) as YAML"),
        ("validate", "check a config; exit 1 with every problem listed, naming its key"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("config", nargs="?", help="experiment YAML (omit for the defaults)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6 rollout.n=8")
        p.set_defaults(func=_config_show if name == "show" else _config_validate)
    p = sub.add_parser("keys", help="list every valid dotted key")
    p.set_defaults(func=_config_keys)


def _config_show(args: argparse.Namespace) -> int:
    from megarl.config import load_config, to_yaml

    print(to_yaml(load_config(args.config, args.overrides, validate=False)), end="")
    return 0


def _config_validate(args: argparse.Namespace) -> int:
    from megarl.config import load_config

    load_config(args.config, args.overrides, validate=True)
    print(f"{args.config or '(defaults)'}: valid")
    return 0


def _config_keys(args: argparse.Namespace) -> int:
    from megarl.config import all_keys

    print("\n".join(all_keys()))
    return 0


def _missing(name: str, helptext: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"megarl {name}: not available in this version ({helptext}).", file=sys.stderr)
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megarl",
        description="Megatron-centric reinforcement learning for LLMs (PPO, GRPO, DAPO and relatives).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_config_commands(subparsers)
    for name, module_name, helptext in _PLUGINS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is None or not module_name.startswith(err.name):
                raise
            p = subparsers.add_parser(name, help=f"{helptext} (not available yet)")
            p.add_argument("args", nargs=argparse.REMAINDER)
            p.set_defaults(func=_missing(name, helptext))
            continue
        module.register_cli(subparsers)
    return parser


def _version() -> str:
    from megarl import __version__

    return f"megarl {__version__}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MegarlError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
