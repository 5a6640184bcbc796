"""RL prompt dataset over parquet files in verl's column layout (see :mod:`megarl.data.schema`).

Files are opened through ``datasets`` (Arrow files memory-mapped from its cache), so a file of
millions of rows is not read into Python objects. Rows are tokenised when they are fetched; with
``filter_overlong_prompts`` one batched pass (``datasets.map``, optionally in ``num_proc`` processes,
cached) measures every prompt, validates every row and drops the prompts longer than
``max_prompt_length``. Only an int64 array of kept row numbers is held in memory.

Every row problem is a DataError naming file, row and column, text that is not UTF-8 included (the
row is found by reading the file's columns again as bytes, :mod:`megarl.data.utf8`). With
``skip_bad_rows`` such rows are left out instead, counted (``num_skipped_bad_rows``) and logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from megarl.data.padding import TRUNCATION_MODES, PromptTooLongError, left_pad, truncate_ids
from megarl.data.prompt import PromptRenderer
from megarl.data.row_check import BAD_ROW_LENGTH, RowChecker, RowLocator, style_of
from megarl.data.schema import (
    ABILITY,
    DATA_SOURCE,
    EXTRA_INFO,
    GROUND_TRUTH,
    REWARD_MODEL,
    check_columns,
    read_parquet_schema,
    row_error,
)
from megarl.data.utf8 import non_utf8_rows
from megarl.errors import ConfigError, DataError
from megarl.protocol.batch import Batch

logger = logging.getLogger(__name__)

PAD_TO_MODES = ("max_length", "longest")
# v3: a skipped row's problem names its row in the file (v2 cached numbers shifted past non-UTF-8 rows).
_FINGERPRINT_VERSION = "megarl-prompt-length-v3"
_LOGGED_PROBLEMS = 3  # skipped rows whose problem is logged in full


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Silence datasets' progress bars for the duration (restoring the caller's setting)."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _file_fingerprint(path: str) -> str:
    stat = os.stat(path)
    return f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}"


class _RowsOfSelection:
    """The row checker over a selection of the rows: ``datasets.map`` numbers the selection's rows
    from 0, the checker must name each row by its global number (so by its row in its file)."""

    def __init__(self, checker: RowChecker, rows: np.ndarray) -> None:
        self.checker = checker
        self.rows = rows  # selection position -> global row (int64)

    def __call__(self, *columns: list[Any]) -> dict[str, list[Any]]:
        *values, positions = columns
        return self.checker(*values, self.rows[np.asarray(positions, dtype=np.int64)].tolist())


class RLDataset:
    """Prompts from parquet files, tokenised on access, collated into left-padded batches.

    Args:
        parquet_files: one path or a list; rows are concatenated in order.
        tokenizer: a HF tokenizer (see :func:`megarl.data.tokenizer.load_tokenizer`); its pad id pads.
        prompt_key: the column holding chat messages (or plain strings).
        max_prompt_length: P, in tokens.
        truncation: ``error`` | ``left`` | ``right`` | ``middle`` for prompts over P that were not
            filtered out (see :func:`megarl.data.padding.truncate_ids`).
        filter_overlong_prompts: drop prompts over P at construction (counted in
            ``num_dropped_overlong`` and logged); also validates every row up front.
        apply_chat_template: ``auto`` (use the tokenizer's template when it has one) | true | false.
        pad_to: ``max_length`` pads every batch to P (verl's layout); ``longest`` to the batch's longest.
        require_ground_truth: ``reward_model.ground_truth`` must be present (rule-based rewards).
        model_scored_rows: rows whose ``reward_model.style`` is "model" are judged by a reward model:
            they need no ground truth, and their data sources need no rule scorer.
        skip_bad_rows: leave out rows that fail their checks (prompt, one the chat template refuses
            included, data_source, ground truth, ``extra_info`` with ``tools``, text that is not UTF-8)
            instead of raising; counted in ``num_skipped_bad_rows`` and logged.
        tools: the names of the run's multi-turn tools (``rollout.multi_turn.tools``, as the tools name
            themselves); every row's ``extra_info`` is then checked when the dataset is opened: null or
            a mapping whose ``tools_kwargs`` names only these tools. None: a run without tools.
        num_proc: processes for the length pass (None: this process).
        cache_dir: ``datasets`` cache directory (None: its default).
    """

    def __init__(
        self,
        parquet_files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        tokenizer: PreTrainedTokenizerBase,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        truncation: str = "error",
        filter_overlong_prompts: bool = True,
        apply_chat_template: bool | str | None = "auto",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        pad_to: str = "max_length",
        require_ground_truth: bool = True,
        model_scored_rows: bool = False,
        skip_bad_rows: bool = False,
        tools: Sequence[str] | None = None,
        num_proc: int | None = None,
        cache_dir: str | None = None,
    ) -> None:
        files = (
            [os.fspath(parquet_files)]
            if isinstance(parquet_files, (str, os.PathLike))
            else [os.fspath(f) for f in parquet_files]
        )
        if not files:
            raise ConfigError("RLDataset: no parquet files given")
        if truncation not in TRUNCATION_MODES:
            raise ConfigError(f"truncation must be one of {list(TRUNCATION_MODES)}, got {truncation!r}")
        if pad_to not in PAD_TO_MODES:
            raise ConfigError(f"pad_to must be one of {list(PAD_TO_MODES)}, got {pad_to!r}")
        if max_prompt_length < 1:
            raise ConfigError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise ConfigError("RLDataset: the tokenizer has neither a pad nor an eos token")

        self.files = files
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.pad_to = pad_to
        self.pad_token_id = int(pad_id)
        self.require_ground_truth = require_ground_truth
        self.model_scored_rows = model_scored_rows
        self.skip_bad_rows = skip_bad_rows
        self.tools = None if tools is None else sorted(tools)
        self.renderer = PromptRenderer(tokenizer, apply_chat_template, chat_template_kwargs)

        required = [prompt_key, DATA_SOURCE] + ([REWARD_MODEL] if require_ground_truth else [])
        for path in files:
            check_columns(path, read_parquet_schema(path), required)
        parts = [self._open(path, cache_dir) for path in files]
        self._locate = RowLocator(files, [len(p) for p in parts])
        try:
            self._table = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        except ValueError as exc:
            raise DataError(
                f"files {files} have columns of different types and cannot be concatenated: {exc}"
            ) from exc
        self.num_rows_read = len(self._table)
        self._checker = RowChecker(
            self.renderer,
            self._locate,
            prompt_key,
            require_ground_truth,
            REWARD_MODEL in self._table.column_names,
            model_scored_rows,
            skip_bad_rows,
            self.tools,
            EXTRA_INFO in self._table.column_names,
        )

        # Dataset index -> global row; None keeps every row (index == row).
        self._kept_rows: np.ndarray | None = None
        self.num_dropped_overlong = 0
        self.num_skipped_bad_rows = 0
        self._skipped_rows = np.zeros(0, dtype=np.int64)  # global rows left out as bad
        self.prompt_lengths: np.ndarray | None = None  # per kept row, when measured
        if filter_overlong_prompts or skip_bad_rows:
            lengths = self._measure_prompts(num_proc)
            bad = lengths == BAD_ROW_LENGTH
            overlong = ~bad & (lengths > max_prompt_length) if filter_overlong_prompts else np.zeros_like(bad)
            keep = ~bad & ~overlong
            self._kept_rows = np.flatnonzero(keep).astype(np.int64)
            self.prompt_lengths = lengths[keep]
            self.num_dropped_overlong = int(overlong.sum())
            self.num_skipped_bad_rows = int(bad.sum())
            self._skipped_rows = np.flatnonzero(bad).astype(np.int64)
            if self.num_dropped_overlong:
                logger.warning(
                    "dropped %d of %d prompts longer than max_prompt_length=%d (files: %s)",
                    self.num_dropped_overlong,
                    self.num_rows_read,
                    max_prompt_length,
                    files,
                )
        elif self._checker.reads_extra_info:  # no pass over the rows: check the tools' arguments now
            self._check_extra_info()
        if len(self) == 0:
            raise DataError(
                f"{files}: no rows left (read {self.num_rows_read}, "
                f"dropped {self.num_dropped_overlong} overlong, skipped {self.num_skipped_bad_rows} bad)"
            )

    @classmethod
    def from_config(
        cls, data: Any, files: Sequence[str], tokenizer: PreTrainedTokenizerBase, **overrides: Any
    ) -> RLDataset:
        """From the ``data`` section of the experiment config (prompt_key, max_prompt_length,
        truncation, filter_overlong_prompts, skip_bad_rows, apply_chat_template); ``overrides`` win."""
        options = {
            "prompt_key": data.prompt_key,
            "max_prompt_length": data.max_prompt_length,
            "truncation": data.truncation,
            "filter_overlong_prompts": data.filter_overlong_prompts,
            "skip_bad_rows": data.skip_bad_rows,
            "apply_chat_template": data.apply_chat_template,
        }
        return cls(files, tokenizer, **{**options, **overrides})

    @staticmethod
    def _open(path: str, cache_dir: str | None) -> datasets.Dataset:
        try:
            with _quiet_datasets():
                return datasets.load_dataset("parquet", data_files=[path], split="train", cache_dir=cache_dir)
        except Exception as exc:  # datasets wraps arrow errors in several types; name the file once
            raise DataError(f"{path}: could not be loaded ({type(exc).__name__}: {exc})") from exc

    def _measure_prompts(self, num_proc: int | None) -> np.ndarray:
        """Prompt length of every row read; BAD_ROW_LENGTH for a row skipped (``skip_bad_rows``)."""
        lengths = np.full(self.num_rows_read, BAD_ROW_LENGTH, dtype=np.int64)
        problems: dict[int, str] = {}
        rows = np.arange(self.num_rows_read, dtype=np.int64)
        if self.skip_bad_rows:  # text that cannot be decoded never reaches the checker
            for row, problem in self._non_utf8().items():
                problems[row] = problem
            rows = np.setdiff1d(rows, np.fromiter(problems, dtype=np.int64, count=len(problems)))
        if len(rows) == self.num_rows_read:
            table, check = self._table, self._checker
        else:
            table, check = self._table.select(rows), _RowsOfSelection(self._checker, rows)
        digest = hashlib.sha256()
        for part in [
            _FINGERPRINT_VERSION,
            self.prompt_key,
            str(self.require_ground_truth),
            str(self.model_scored_rows),
            str(self.skip_bad_rows),
            ",".join(map(str, sorted(problems))),
            repr(self.tools),
            *map(_file_fingerprint, self.files),
            *self.renderer.fingerprint_parts(),
        ]:
            digest.update(part.encode())
            digest.update(b"\0")
        try:
            with _quiet_datasets():
                measured = table.map(
                    check,
                    batched=True,
                    batch_size=1000,
                    with_indices=True,
                    input_columns=self._checker.input_columns,
                    remove_columns=table.column_names,
                    num_proc=num_proc,
                    new_fingerprint=digest.hexdigest()[:32],
                )
        except UnicodeDecodeError:
            raise self._utf8_error() from None
        measured = measured.with_format("numpy")
        # The pass numbers the rows of `table`: map them back to global rows.
        lengths[rows] = measured["prompt_length"][:].astype(np.int64)
        if self.skip_bad_rows:
            skipped = rows[lengths[rows] == BAD_ROW_LENGTH]
            if len(skipped):
                texts = measured.with_format(None).select(
                    np.flatnonzero(lengths[rows] == BAD_ROW_LENGTH)[:_LOGGED_PROBLEMS])["problem"]
                problems.update(zip(skipped[:_LOGGED_PROBLEMS].tolist(), texts))
                problems.update({int(r): "" for r in skipped[_LOGGED_PROBLEMS:]})
            if problems:
                first = sorted(problems)[:_LOGGED_PROBLEMS]
                logger.warning(
                    "skipped %d of %d rows that fail their checks (data.skip_bad_rows); the first: %s",
                    len(problems), self.num_rows_read, "; ".join(problems[r] for r in first),
                )
        return lengths

    def _check_extra_info(self) -> None:
        """Every row's ``extra_info`` against the run's tools (:meth:`RowChecker.check_extra_info`)."""
        column = self._table.select_columns([EXTRA_INFO])
        row = 0
        try:
            for batch in column.iter(batch_size=10000):
                for extra_info in batch[EXTRA_INFO]:
                    self._checker.check_extra_info(row, extra_info)
                    row += 1
        except UnicodeDecodeError:
            raise self._utf8_error() from None

    def _non_utf8(self) -> dict[int, str]:
        """Global row -> problem, for every row holding text that is not valid UTF-8."""
        found: dict[int, str] = {}
        for path, start in zip(self.files, self._locate.starts):
            for row, column, problem in non_utf8_rows(path):
                found.setdefault(int(start) + row, str(row_error(path, row, column, problem)))
        return found

    def _utf8_error(self, rows: Sequence[int] | None = None) -> DataError:
        """The DataError for the first row (of ``rows``, default all) whose text is not UTF-8."""
        wanted = None if rows is None else set(rows)
        for path, start in zip(self.files, self._locate.starts):
            for row, column, problem in non_utf8_rows(path):
                if wanted is None or int(start) + row in wanted:
                    return row_error(path, row, column, problem)
        return DataError(f"{self.files}: text that is not valid UTF-8 (the row could not be located)")

    def __len__(self) -> int:
        return self.num_rows_read if self._kept_rows is None else len(self._kept_rows)

    def _global_row(self, index: int) -> int:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for a dataset of {len(self)} rows")
        index %= len(self)
        return index if self._kept_rows is None else int(self._kept_rows[index])

    def locate(self, index: int) -> tuple[str, int]:
        """(file, row within that file) of dataset index ``index``."""
        return self._locate(self._global_row(index))

    def _rows_checked(self) -> datasets.Dataset:
        """Every row read, less the rows skipped as bad (overlong rows stay)."""
        if not self.num_skipped_bad_rows:
            return self._table
        return self._table.select(np.setdiff1d(np.arange(self.num_rows_read), self._skipped_rows))

    def data_sources(self) -> list[str]:
        """The distinct ``data_source`` values of all rows read (before the overlong filter; rows
        skipped as bad left out)."""
        try:
            return sorted(str(s) for s in self._rows_checked().unique(DATA_SOURCE))
        except UnicodeDecodeError:
            raise self._utf8_error() from None

    def rule_data_sources(self) -> list[str]:
        """The distinct ``data_source`` values of the rows the rule scorers judge: every row, or with
        ``model_scored_rows`` those whose ``reward_model.style`` is not "model"."""
        if not self.model_scored_rows or REWARD_MODEL not in self._table.column_names:
            return self.data_sources()
        columns = self._rows_checked().select_columns([DATA_SOURCE, REWARD_MODEL])
        try:
            return sorted({str(source) for batch in columns.iter(batch_size=10000)
                           for source, reward_model in zip(batch[DATA_SOURCE], batch[REWARD_MODEL])
                           if style_of(reward_model) != "model"})
        except UnicodeDecodeError:
            raise self._utf8_error() from None

    def has_model_scored_rows(self) -> bool:
        """Whether a row's ``reward_model.style`` is "model" (rows skipped as bad left out; False
        without the column). Stops at the first such row."""
        if REWARD_MODEL not in self._table.column_names:
            return False
        column = self._rows_checked().select_columns([REWARD_MODEL])
        return any(style_of(reward_model) == "model"
                   for batch in column.iter(batch_size=10000) for reward_model in batch[REWARD_MODEL])

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.get_rows([index])[0]

    def get_rows(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Fetch and tokenise rows. Each row: ``input_ids`` (list[int], truncated, unpadded),
        ``raw_prompt``, ``data_source``, ``ground_truth``, ``reward_style`` (the row's
        ``reward_model.style``: "rule", "model" or None), ``extra_info`` (dict), ``ability``,
        ``index`` (dataset index) and ``row`` (global row over the files)."""
        rows = [self._global_row(int(i)) for i in indices]
        try:
            columns = self._table[rows]
        except UnicodeDecodeError:
            raise self._utf8_error(rows) from None
        missing = [None] * len(rows)
        sources = columns[DATA_SOURCE]
        reward_models = columns.get(REWARD_MODEL, missing)
        extra_infos = columns.get(EXTRA_INFO, missing)
        prompts = [
            self._checker.check(*fields)
            for fields in zip(rows, columns[self.prompt_key], sources, reward_models, extra_infos)
        ]
        token_ids = self.renderer.encode_texts([self._checker.render(row, p) for row, p in zip(rows, prompts)])
        examples = []
        for k, (row, reward_model, extra_info, ability) in enumerate(
            zip(rows, reward_models, extra_infos, columns.get(ABILITY, missing))
        ):
            try:
                ids = truncate_ids(token_ids[k], self.max_prompt_length, self.truncation)
            except PromptTooLongError as exc:
                raise row_error(
                    *self._locate(row),
                    self.prompt_key,
                    f"{exc}; set truncation to left/right/middle or filter_overlong_prompts",
                ) from None
            examples.append(
                {
                    "input_ids": ids,
                    "raw_prompt": prompts[k],
                    "data_source": sources[k],
                    "ground_truth": reward_model.get(GROUND_TRUTH)
                    if isinstance(reward_model, dict)
                    else None,
                    "reward_style": style_of(reward_model),
                    "extra_info": extra_info or {},
                    "ability": ability,
                    "index": int(indices[k]) % len(self),
                    "row": row,
                }
            )
        return examples

    def collate(self, examples: Sequence[Mapping[str, Any]], uids: Sequence[str] | None = None) -> Batch:
        """Left-pad examples from :meth:`get_rows` into a Batch.

        Tensors (B, P) int64: ``input_ids``, ``attention_mask``, ``position_ids``. Object columns:
        ``uid`` (default: the global row number as a string), ``data_source``, ``ground_truth``, ``reward_style``,
        ``extra_info``, ``raw_prompt``, ``ability``, ``index``.
        """
        if uids is not None and len(uids) != len(examples):
            raise ValueError(f"{len(uids)} uids for {len(examples)} examples")
        length = self.max_prompt_length if self.pad_to == "max_length" else None
        input_ids, attention_mask, position_ids = left_pad(
            [e["input_ids"] for e in examples], self.pad_token_id, length
        )
        non_tensors = {
            "uid": list(uids) if uids is not None else [str(e["row"]) for e in examples],
            **{
                key: [e[key] for e in examples]
                for key in ("data_source", "ground_truth", "reward_style", "extra_info", "raw_prompt", "ability",
                            "index")
            },
        }
        return Batch.from_dict(
            {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
            non_tensors=non_tensors,
        )
