"""``megarl data make TASK`` (synthetic datasets) and ``megarl data inspect FILE``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from megarl.argtypes import positive_int
from megarl.data.parquet_io import write_parquet
from megarl.data.schema import read_parquet_schema
from megarl.data.tasks import ArithmeticTask, CountdownTask
from megarl.data.tasks.arithmetic_tools import ArithmeticToolsTask, build_tools_tokenizer
from megarl.data.tokenizer import build_char_tokenizer
from megarl.errors import ConfigError

_rows = positive_int("number of rows", " (both splits are written; a config without validation sets "
                     "data.val_files: [])")


def _add_common(parser: argparse.ArgumentParser, char_tokenizer: bool = True) -> None:
    parser.add_argument("--out", required=True, help="output directory: train.parquet, val.parquet")
    parser.add_argument("--train-size", type=_rows, default=1000)
    parser.add_argument("--val-size", type=_rows, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer-out", help="also write a tokenizer covering the task to this directory (a character "
        "tokenizer; arithmetic_tools: ChatML with the tool-call tags as single tokens)"
    )
    if char_tokenizer:
        parser.add_argument("--extra-chars", default="", help="more characters for the character tokenizer (e.g. letters)")


# The arithmetic task's options: None on the command line when not given, so that the task's own
# defaults apply and one given together with --preset (which sets them all) is refused, not ignored.
ARITHMETIC_OPTIONS = ("num_operands", "min_value", "max_value", "operators")


def _arithmetic(args: argparse.Namespace) -> ArithmeticTask:
    options = {name: getattr(args, name) for name in ARITHMETIC_OPTIONS if getattr(args, name) is not None}
    given = [*options, *(name for name in ("no_negative", "spaces") if getattr(args, name))]
    if args.preset == "single_digit_addition":
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ConfigError(f"data make arithmetic: --preset {args.preset} sets the task's options; remove {flags} "
                              "or the preset")
        return ArithmeticTask.single_digit_addition()
    return ArithmeticTask(
        **options,
        allow_negative_results=not args.no_negative,
        spaces=args.spaces,
    )


def _countdown(args: argparse.Namespace) -> CountdownTask:
    return CountdownTask(
        num_numbers=args.num_numbers,
        min_number=args.min_number,
        max_number=args.max_number,
        min_target=args.min_target,
        max_target=args.max_target,
        operators=args.operators,
        prompt_style=args.prompt_style,
    )


def make(args: argparse.Namespace) -> int:
    if args.task == "arithmetic_tools":
        task: Any = ArithmeticToolsTask(digits=args.digits, operators=args.operators)
    else:
        task = _arithmetic(args) if args.task == "arithmetic" else _countdown(args)
    out = Path(args.out)
    for split, size in (("train", args.train_size), ("val", args.val_size)):
        count = write_parquet(task.rows(size, args.seed, split), out / f"{split}.parquet")
        print(f"{split}: {count} rows -> {out / f'{split}.parquet'}")
    if args.tokenizer_out:
        if args.task == "arithmetic_tools":  # ChatML and the tool-call tags as single tokens
            tokenizer = build_tools_tokenizer(args.tokenizer_out)
        else:
            tokenizer = build_char_tokenizer(task.alphabet() + args.extra_chars, args.tokenizer_out)
        print(f"tokenizer: {len(tokenizer)} tokens -> {args.tokenizer_out}")
    return 0


def _short(value: Any, width: int = 200) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


def inspect(args: argparse.Namespace) -> int:
    schema = read_parquet_schema(args.file)
    parquet = pq.ParquetFile(args.file)
    print(f"file: {args.file}")
    print(f"rows: {parquet.metadata.num_rows}")
    print("schema:")
    for field in schema:
        print(f"  {field.name}: {field.type}")
    if args.rows > 0 and parquet.metadata.num_rows:
        batch = next(parquet.iter_batches(batch_size=args.rows))
        for index, row in enumerate(batch.to_pylist()):
            print(f"row {index}:")
            for key, value in row.items():
                print(f"  {key}: {_short(value)}")
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``data make`` and ``data inspect``; each leaf sets ``func(args) -> exit code``."""
    data = subparsers.add_parser("data", help="make synthetic datasets, inspect parquet files")
    commands = data.add_subparsers(dest="data_command", required=True)

    make_parser = commands.add_parser("make", help="write a synthetic RL dataset (train/val parquet)")
    tasks = make_parser.add_subparsers(dest="task", required=True)
    arithmetic = tasks.add_parser("arithmetic", help='"3+4=" -> "7"')
    _add_common(arithmetic)
    arithmetic.add_argument(
        "--preset", choices=["single_digit_addition"], help="overrides the task options below"
    )
    arithmetic.add_argument("--num-operands", type=int, help=f"default {ArithmeticTask.num_operands}")
    arithmetic.add_argument("--min-value", type=int, help=f"default {ArithmeticTask.min_value}")
    arithmetic.add_argument("--max-value", type=int, help=f"default {ArithmeticTask.max_value}")
    arithmetic.add_argument("--operators", help=f"subset of '+-*' (default {ArithmeticTask.operators!r})")
    arithmetic.add_argument(
        "--no-negative", action="store_true", help="redraw expressions with a negative result"
    )
    arithmetic.add_argument("--spaces", action="store_true", help='"3 + 4 =" instead of "3+4="')
    arithmetic.set_defaults(func=make)
    countdown = tasks.add_parser("countdown", help="reach a target from given numbers")
    _add_common(countdown)
    countdown.add_argument("--num-numbers", type=int, default=3)
    countdown.add_argument("--min-number", type=int, default=1)
    countdown.add_argument("--max-number", type=int, default=20)
    countdown.add_argument("--min-target", type=int, default=1)
    countdown.add_argument("--max-target", type=int, default=100)
    countdown.add_argument("--operators", default="+-*/")
    countdown.add_argument("--prompt-style", choices=["compact", "verbose"], default="compact")
    countdown.set_defaults(func=make)

    tools = tasks.add_parser("arithmetic_tools", help='"483920+771035=" with a calculator tool (multi-turn)')
    _add_common(tools, char_tokenizer=False)  # its tokenizer is ChatML with the tool-call tags
    tools.add_argument("--digits", type=int, default=6, help="digits of each operand")
    tools.add_argument("--operators", default="+", help="subset of '+-*'")
    tools.set_defaults(func=make)

    inspect_parser = commands.add_parser(
        "inspect", help="print schema, row count and first rows of a parquet file"
    )
    inspect_parser.add_argument("file")
    inspect_parser.add_argument("--rows", type=int, default=3)
    inspect_parser.set_defaults(func=inspect)
