"""Per-row checks of an RL dataset, run in one batched pass (``datasets.map``, picklable) or on fetch.

A row's problem is a :class:`~megarl.errors.DataError` naming file, row and column; with
``skip_bad_rows`` the pass records it instead (prompt length -1 and the message), so that the
dataset can leave the row out, count it and log it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megarl.data.prompt import PromptRenderer
from megarl.data.schema import DATA_SOURCE, REWARD_MODEL, ground_truth_of, row_error, validate_prompt
from megarl.errors import DataError

BAD_ROW_LENGTH = -1  # the prompt length the pass reports for a row it skipped


class RowLocator:
    """Maps a global row number (over the concatenated files) to (file, row within file)."""

    def __init__(self, files: Sequence[str], row_counts: Sequence[int]) -> None:
        self.files = list(files)
        self.starts = np.concatenate([[0], np.cumsum(row_counts)]).astype(np.int64)

    def __call__(self, global_row: int) -> tuple[str, int]:
        position = int(np.searchsorted(self.starts, global_row, side="right")) - 1
        return self.files[position], int(global_row - self.starts[position])


# Who judges a row (``reward_model.style``): the rule scorers, or a reward model (`reward_model.*`).
# A style beginning with "rule-" (public datasets name the rule: DAPO-Math-17k's
# "rule-lighteval/MATH_v2") is "rule".
REWARD_STYLES = ("rule", "model")


def style_of(reward_model: Any) -> Any:
    """A row's ``reward_model.style`` ("rule", "model"; "rule-..." read as "rule"), None when it has none."""
    style = reward_model.get("style") if isinstance(reward_model, dict) else None
    return "rule" if isinstance(style, str) and style.startswith("rule-") else style


class RowChecker:
    """Validates rows and measures prompt lengths; runs inside ``datasets.map`` (picklable)."""

    def __init__(
        self,
        renderer: PromptRenderer,
        locate: RowLocator,
        prompt_key: str,
        require_ground_truth: bool,
        has_reward_model: bool,
        model_scored_rows: bool = False,
        skip_bad_rows: bool = False,
    ) -> None:
        self.renderer = renderer
        self.locate = locate
        self.prompt_key = prompt_key
        self.require_ground_truth = require_ground_truth
        self.model_scored_rows = model_scored_rows
        self.skip_bad_rows = skip_bad_rows
        # The columns ``datasets.map`` passes, in order (then the row numbers).
        self.input_columns = [prompt_key, DATA_SOURCE] + ([REWARD_MODEL] if has_reward_model else [])

    def check(self, global_row: int, prompt: Any, data_source: Any, reward_model: Any) -> Any:
        """Return the validated prompt; DataError naming file, row and column otherwise."""
        try:
            prompt = validate_prompt(prompt)
        except ValueError as exc:
            raise row_error(*self.locate(global_row), self.prompt_key, str(exc)) from None
        if not isinstance(data_source, str) or not data_source:
            raise row_error(
                *self.locate(global_row), DATA_SOURCE, f"expected a non-empty string, got {data_source!r}"
            )
        style = style_of(reward_model)
        if style is not None and style not in REWARD_STYLES:
            raise row_error(*self.locate(global_row), REWARD_MODEL,
                            f"style {style!r}; valid: {list(REWARD_STYLES)}, 'rule-<name>' (a rule) or none ('rule')")
        if self.require_ground_truth and not (self.model_scored_rows and style == "model"):
            try:
                ground_truth_of(reward_model)
            except ValueError as exc:
                raise row_error(*self.locate(global_row), REWARD_MODEL, str(exc)) from None
        return prompt

    def __call__(self, *columns: list[Any]) -> dict[str, list[Any]]:
        """``prompt_length`` of each row (BAD_ROW_LENGTH for a skipped row) and ``problem`` ("" or
        the skipped row's error)."""
        prompts, sources, rows = columns[0], columns[1], columns[-1]
        reward_models = columns[2] if len(columns) == 4 else [None] * len(rows)
        checked, problems = [], []
        for r, p, s, m in zip(rows, prompts, sources, reward_models):
            try:
                checked.append(self.check(r, p, s, m))
                problems.append("")
            except DataError as exc:
                if not self.skip_bad_rows:
                    raise
                checked.append(None)
                problems.append(str(exc))
        lengths = self.renderer.lengths([c for c in checked if c is not None])
        measured = iter(lengths)
        return {
            "prompt_length": [BAD_ROW_LENGTH if c is None else next(measured) for c in checked],
            "problem": problems,
        }
