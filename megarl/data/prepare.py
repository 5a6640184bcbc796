"""Convert GSM8K and MATH-style datasets to megarl's parquet layout (verl's columns).

Sources: a local copy (a parquet/jsonl/json file, or a directory holding the original files, e.g.
``main/train-00000-of-00001.parquet`` for GSM8K or ``train/algebra/1.json`` for the original MATH
release), or a HF hub dataset through ``datasets.load_dataset`` when the hub is reachable.
Rows are streamed from parquet and jsonl files; a ``.json`` file (one JSON document) is read whole.

With ``tools`` (``--tools code_interpreter``) the rows are for multi-turn rollouts: the prompt starts
with a system message that gives the tools' OpenAI schemas and the Hermes/Qwen call format
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Qwen2.5's chat template writes it;
the data loader does not render tool schemas itself), and ``extra_info.tools_kwargs`` holds each
tool's per-row arguments in verl's layout, ``{tool: {"create_kwargs": {"ground_truth": answer}}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from megarl.agent.tools import BUILTIN_TOOLS
from megarl.data.parquet_io import write_parquet
from megarl.data.tasks.rows import verl_row
from megarl.errors import DataError, MegarlError
from megarl.rewards.scorers.math import extract_boxed
from megarl.rewards.scorers.numbers import parse_number

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SOURCE_SUFFIXES = (".parquet", ".jsonl", ".json")
TOOLS_PREAMBLE = (  # Qwen2.5's chat template writes these words when it is given tools
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{schemas}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)

Located = tuple[str, int, dict[str, Any]]  # (file, row within file, row)


def _read_file(path: Path) -> Iterator[Located]:
    if path.suffix == ".parquet":
        row = 0
        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
                for record in batch.to_pylist():
                    yield str(path), row, record
                    row += 1
        except (OSError, pa.ArrowInvalid) as exc:  # a corrupt file is ArrowInvalid, a ValueError
            raise DataError(f"{path}: not a readable parquet file ({exc})") from exc
        return
    with open(path, encoding="utf-8") as handle:
        if path.suffix == ".json":
            try:
                content = json.load(handle)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: invalid JSON ({exc})") from exc
            records = content if isinstance(content, list) else [content]
            for row, record in enumerate(records):
                yield str(path), row, record
            return
        for row, line in enumerate(handle):
            if not line.strip():
                continue
            try:
                yield str(path), row, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: row {row} is not valid JSON ({exc.msg})") from exc


def _mentions_split(relative: Path, split: str) -> bool:
    tokens = [*relative.parts[:-1], *re.split(r"[-_.]", relative.name)]
    return split in tokens


def local_split_files(local: str | os.PathLike[str], split: str) -> list[Path]:
    """The source files of ``split`` under a directory (the split's name in a folder or file name)."""
    root = Path(local)
    if not root.exists():
        raise DataError(f"{root}: does not exist")
    if root.is_file():
        return [root]
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and p.suffix in SOURCE_SUFFIXES and _mentions_split(p.relative_to(root), split)
    )
    if not files:
        raise DataError(
            f"{root}: no {'/'.join(SOURCE_SUFFIXES)} file for split '{split}' "
            "(the split name must appear in a folder or file name)"
        )
    return files


# GSM8K ships two configurations of the same questions: "main" and "socratic" (the solution as
# sub-questions). A local copy often holds both, as main/ and socratic/ folders (the hub) or as
# train.jsonl and train_socratic.jsonl (OpenAI's release); reading both would give every row twice.
GSM8K_VARIANTS = ("main", "socratic")
GSM8K_MAIN = "main"
# Name parts that tell no variant apart: the split-file shards' "-00000-of-00002", the suffixes.
_SHARD_TOKEN = re.compile(r"\d+|of")


def _variant_tokens(relative: Path, split: str) -> tuple[str, ...]:
    """What distinguishes a split's file from its sibling variants: its folder and name parts less the
    split name, shard numbers and the suffix (``main/train-00000-of-00001.parquet`` -> ("main",))."""
    tokens = [*relative.parts[:-1], *re.split(r"[-_.]", relative.name)]
    suffixes = {suffix.lstrip(".") for suffix in SOURCE_SUFFIXES}
    return tuple(t for t in tokens if t and t != split and t not in suffixes and not _SHARD_TOKEN.fullmatch(t))


def gsm8k_split_files(local: str | os.PathLike[str], split: str) -> list[Path]:
    """``local_split_files`` with one GSM8K variant: the main one (files naming "main" or no variant)
    when present, else the only one there. A DataError listing the files when a file names both
    variants, or when the chosen files differ in other name parts (two copies of one split, such as
    ``train.jsonl`` beside ``main/train-00000-of-00001.parquet``, cannot be told apart)."""
    files = local_split_files(local, split)
    root = Path(local)
    if root.is_file():  # the user named the one file to read
        return files
    keys = {path: _variant_tokens(path.relative_to(root), split) for path in files}

    def variant(key: tuple[str, ...]) -> str | None:
        named = {t for t in key if t in GSM8K_VARIANTS}
        return GSM8K_MAIN if not named else named.pop() if len(named) == 1 else None

    groups: dict[str | None, list[Path]] = {}
    for path in files:
        groups.setdefault(variant(keys[path]), []).append(path)
    chosen = groups.get(GSM8K_MAIN) or (next(iter(groups.values())) if len(groups) == 1 else [])
    if None in groups or len({keys[path] for path in chosen}) != 1:
        listing = "\n  ".join(f"{p.relative_to(root)} (variant {variant(keys[p]) or 'unclear'})" for p in files)
        raise DataError(
            f"{root}: the files for split '{split}' span several copies or variants that cannot be told "
            f"apart, and reading them all would repeat rows:\n  {listing}\n"
            f"Pass --local the folder or file of one variant (GSM8K's '{GSM8K_MAIN}' is the usual one)"
        )
    return chosen


def read_local_split(local: str | os.PathLike[str], split: str,
                     select: Callable[[str | os.PathLike[str], str], list[Path]] = local_split_files,
                     ) -> Iterator[Located]:
    for path in select(local, split):
        yield from _read_file(path)


def read_hub_split(name: str, config: str | None, split: str) -> Iterator[Located]:
    """Rows of a hub dataset; DataError suggesting ``--local`` when the hub cannot be reached."""
    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # offline, unknown name, ...: all end the same way for the user
        raise DataError(
            f"could not load '{name}' ({config}) split '{split}' from the hub: {exc}. "
            "Pass --local DIR_OR_FILE"
        ) from exc
    for row, record in enumerate(dataset):
        yield f"{name}:{split}", row, record


def _field(file: str, row: int, record: Any, column: str) -> str:
    if not isinstance(record, Mapping):
        raise DataError(f"{file}: row {row} is a {type(record).__name__}, not an object with a '{column}' field")
    value = record.get(column)
    if not isinstance(value, str) or not value.strip():
        raise DataError(
            f"{file}: row {row}, column '{column}': missing or not a non-empty string (got {value!r:.60})"
        )
    return value


def gsm8k_final_answer(answer: str) -> str:
    """The number after ``####`` in a GSM8K reference solution, without thousands commas."""
    if "####" not in answer:
        raise ValueError("no '####' final answer")
    return answer.split("####")[-1].strip().replace(",", "")


def tools_system_message(tools: Sequence[str]) -> dict[str, str]:
    """The system message that describes the built-in `tools` (names in megarl.agent.tools.BUILTIN_TOOLS)
    to the model: their OpenAI schemas, one JSON object a line, and the Hermes call format."""
    unknown = [name for name in tools if name not in BUILTIN_TOOLS]
    if unknown or not tools:
        raise DataError(f"--tools: unknown or no tool names {unknown or list(tools)}; "
                        f"built in: {sorted(BUILTIN_TOOLS)}")
    schemas = "\n".join(json.dumps(BUILTIN_TOOLS[name].schema, ensure_ascii=False) for name in tools)
    return {"role": "system", "content": TOOLS_PREAMBLE.format(schemas=schemas)}


def with_tools(row: dict[str, Any], system: dict[str, str] | None, tools: Sequence[str]) -> dict[str, Any]:
    """`row` for multi-turn rollouts: `system` before its prompt, `extra_info.tools_kwargs` with the
    row's ground truth as each tool's create_kwargs. Unchanged when `system` is None."""
    if system is None:
        return row
    ground_truth = row["reward_model"]["ground_truth"]
    row["prompt"] = [dict(system), *row["prompt"]]
    row["extra_info"]["tools_kwargs"] = {name: {"create_kwargs": {"ground_truth": ground_truth}} for name in tools}
    return row


def gsm8k_rows(
    source: Iterator[Located],
    split: str,
    instruction: str = GSM8K_INSTRUCTION,
    data_source: str = "openai/gsm8k",
    tools: Sequence[str] = (),
) -> Iterator[dict[str, Any]]:
    system = tools_system_message(tools) if tools else None
    for index, (file, row, record) in enumerate(source):
        question, answer = _field(file, row, record, "question"), _field(file, row, record, "answer")
        try:
            final = gsm8k_final_answer(answer)
        except ValueError as exc:
            raise DataError(f"{file}: row {row}, column 'answer': {exc}") from None
        if parse_number(final) is None:
            # The gsm8k scorer compares parse_number of the response's answer with this one's: a
            # ground truth it cannot parse scores 0 whatever the model writes.
            raise DataError(
                f"{file}: row {row}, column 'answer': the final answer after '####' is {final!r}, "
                "not a number the gsm8k scorer can match (a number such as 18, -3, 2.5 or 1/2)"
            )
        yield with_tools(verl_row(
            data_source=data_source,
            content=f"{question} {instruction}",
            ground_truth=final,
            ability="math",
            split=split,
            index=index,
            question=question,
            answer=answer,
        ), system, tools)


def math_rows(
    source: Iterator[Located],
    split: str,
    instruction: str = MATH_INSTRUCTION,
    data_source: str = "DigitalLearningGmbH/MATH-lighteval",
    tools: Sequence[str] = (),
) -> Iterator[dict[str, Any]]:
    system = tools_system_message(tools) if tools else None
    for index, (file, row, record) in enumerate(source):
        problem, solution = _field(file, row, record, "problem"), _field(file, row, record, "solution")
        final = extract_boxed(solution)
        if final is None:
            raise DataError(f"{file}: row {row}, column 'solution': no \\boxed{{}} final answer")
        yield with_tools(verl_row(
            data_source=data_source,
            content=f"{problem} {instruction}",
            ground_truth=final,
            ability="math",
            split=split,
            index=index,
            level=str(record.get("level") or ""),
            type=str(record.get("type") or ""),
        ), system, tools)


_TASKS: dict[str, tuple[Callable[..., Iterator[dict[str, Any]]], str, str | None]] = {
    # task: (row converter, default hub dataset, hub config)
    "gsm8k": (gsm8k_rows, "openai/gsm8k", "main"),
    "math": (math_rows, "DigitalLearningGmbH/MATH-lighteval", "default"),
}
# How a local directory's files for a split are chosen; MATH's topic folders (train/algebra/...) are
# all one dataset, so only GSM8K picks a variant.
_LOCAL_FILES: dict[str, Callable[[str | os.PathLike[str], str], list[Path]]] = {"gsm8k": gsm8k_split_files}


def prepare(
    task: str,
    out_dir: str | os.PathLike[str],
    *,
    local: str | None = None,
    hub_name: str | None = None,
    hub_config: str | None = None,
    splits: Sequence[str] = ("train", "test"),
    tools: Sequence[str] = (),
) -> dict[str, int]:
    """Write ``<out_dir>/<split>.parquet`` for each split; returns rows written per split.

    With ``local`` a single file is one split (``splits`` must then name exactly one). With
    ``tools`` (built-in tool names) the rows get the tools' system message and ``tools_kwargs``.
    """
    converter, default_hub, default_config = _TASKS[task]
    if local is not None and Path(local).is_file() and len(splits) != 1:
        raise DataError(
            f"{local}: a single file holds one split; pass --splits with one name (got {list(splits)})"
        )
    counts = {}
    for split in splits:
        if local is not None:
            source = read_local_split(local, split, _LOCAL_FILES.get(task, local_split_files))
        else:
            source = read_hub_split(
                hub_name or default_hub, hub_config or (default_config if hub_name is None else None), split
            )
        counts[split] = write_parquet(converter(source, split, tools=tools), Path(out_dir) / f"{split}.parquet")
    return counts


def main(task: str, argv: Sequence[str] | None = None) -> int:
    """Command line of ``tools/prepare_<task>.py``."""
    parser = argparse.ArgumentParser(description=f"Convert {task} to megarl's parquet layout (verl columns).")
    parser.add_argument("--out", required=True, help="output directory (<split>.parquet files)")
    parser.add_argument("--local", help="local copy: a directory of the splits' files, or a parquet/jsonl/json "
                        "file holding one split (then name it with --splits, e.g. --splits test)")
    parser.add_argument("--hub-name", help=f"hub dataset (default {_TASKS[task][1]}); needs network access")
    parser.add_argument("--hub-config", help="hub dataset configuration")
    parser.add_argument("--splits", nargs="+", default=["train", "test"], help="splits to write (default: train test)")
    parser.add_argument("--tools", nargs="+", default=[], choices=sorted(BUILTIN_TOOLS),
                        help="rows for multi-turn rollouts with these built-in tools (rollout.multi_turn.tools): a "
                             "system message gives their schemas and the Hermes <tool_call> format, and "
                             "extra_info.tools_kwargs their per-row arguments (verl's layout)")
    args = parser.parse_args(argv)
    try:
        counts = prepare(
            task,
            args.out,
            local=args.local,
            hub_name=args.hub_name,
            hub_config=args.hub_config,
            splits=args.splits,
            tools=args.tools,
        )
    except MegarlError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for split, count in counts.items():
        print(f"{split}: {count} rows -> {Path(args.out) / f'{split}.parquet'}")
    return 0
