"""The `megarl` command line: train, config, data, convert, checkpoint, sync, bench, report.

Each subsystem adds its own subcommands through a ``register_cli(subparsers)`` function in its own
module; this file only wires them together. Only the module of the command being run is imported
(several import torch, transformers or Megatron, which take seconds), so `megarl config ...` and
`megarl train` with a config error answer without them.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from typing import Callable, Optional, Sequence

from megarl import __version__
from megarl.config import all_keys, load_config, to_yaml
from megarl.config.run_files import check_run_files
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
        if name == "validate":
            p.add_argument("--schema-only", action="store_true",
                           help="check the config alone, not the files it names (data, tokenizer, model, reward "
                                "function), e.g. a cluster recipe on a laptop")
    p = sub.add_parser("keys", help="list every valid dotted key")
    p.set_defaults(func=_config_keys)


def _config_show(args: argparse.Namespace) -> int:
    print(to_yaml(load_config(args.config, args.overrides, validate=False)), end="")
    return 0


def _config_validate(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides, validate=True)
    if not args.schema_only:
        check_run_files(cfg)  # the checks `megarl train` makes before it writes or starts anything
    print(f"{args.config or '(defaults)'}: valid" + (" (files not checked)" if args.schema_only else ""))
    return 0


def _config_keys(args: argparse.Namespace) -> int:
    print("\n".join(all_keys()))
    return 0


def _missing(name: str, helptext: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"megarl {name}: not available in this version ({helptext}).", file=sys.stderr)
        return 2

    return run


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The `megarl` parser. `command`: the subcommand about to run; only its module is imported, the
    others appear by name and help line (all of them when None, e.g. for `megarl --help`)."""
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
        if name != command:
            p = subparsers.add_parser(name, help=helptext)
            p.add_argument("args", nargs=argparse.REMAINDER)
            continue
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


def _command(argv: Sequence[str]) -> Optional[str]:
    """The subcommand named in `argv` (its first word that is not an option), or None."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _version() -> str:
    return f"megarl {__version__}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command(argv))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MegarlError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (`megarl sync plan --json | head`): no traceback, and none
        # again when the interpreter flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command a closed pipe stopped


def run() -> None:
    """The `megarl` command (and `python -m megarl.cli`): `main`, then exit without the interpreter's
    last garbage collection. That pass walks every object torch, transformers and Ray created (half
    a million after `megarl train`) and took about 1.6 s of each run's exit on a 2-core machine.
    Skipping it only leaves objects in reference cycles to the OS: the run has already closed its
    files, trackers and Ray, and objects outside cycles are still released as modules unload."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
