"""Per-row checks of an RL dataset, run in one batched pass (``datasets.map``, picklable) or on fetch.

A row's problem (its prompt, one the chat template refuses included, data source, ground truth, and
with multi-turn tools its ``extra_info.tools_kwargs``) is a :class:`~megarl.errors.DataError` naming
file, row and column; with ``skip_bad_rows`` the pass records it instead (prompt length -1 and the
message), so that the dataset can leave the row out, count it and log it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megarl.agent.loop import parse_tools_kwargs
from megarl.data.prompt import ChatTemplateError, PromptRenderer
from megarl.data.schema import DATA_SOURCE, EXTRA_INFO, REWARD_MODEL, ground_truth_of, row_error, validate_prompt
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
    """Validates rows, renders their prompts and measures their lengths; runs inside ``datasets.map``
    (picklable).

    ``tools``: the names of the run's multi-turn tools; with them each row's ``extra_info`` must be a
    mapping (or null) whose ``tools_kwargs`` names only those tools (None: the column is not read).
    """

    def __init__(
        self,
        renderer: PromptRenderer,
        locate: RowLocator,
        prompt_key: str,
        require_ground_truth: bool,
        has_reward_model: bool,
        model_scored_rows: bool = False,
        skip_bad_rows: bool = False,
        tools: Sequence[str] | None = None,
        has_extra_info: bool = False,
    ) -> None:
        self.renderer = renderer
        self.locate = locate
        self.prompt_key = prompt_key
        self.require_ground_truth = require_ground_truth
        self.model_scored_rows = model_scored_rows
        self.skip_bad_rows = skip_bad_rows
        self.tools = None if tools is None else sorted(tools)
        self.has_reward_model = has_reward_model
        self.reads_extra_info = self.tools is not None and has_extra_info
        # The columns ``datasets.map`` passes, in order (then the row numbers).
        self.input_columns = ([prompt_key, DATA_SOURCE] + ([REWARD_MODEL] if has_reward_model else [])
                              + ([EXTRA_INFO] if self.reads_extra_info else []))

    def check(self, global_row: int, prompt: Any, data_source: Any, reward_model: Any, extra_info: Any = None) -> Any:
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
        if self.tools is not None:
            self.check_extra_info(global_row, extra_info)
        return prompt

    def check_extra_info(self, global_row: int, extra_info: Any) -> None:
        """With the run's tools: ``extra_info`` null or a mapping whose ``tools_kwargs`` fits them."""
        if extra_info is not None and not isinstance(extra_info, dict):
            raise row_error(*self.locate(global_row), EXTRA_INFO,
                            f"expected a mapping (holding tools_kwargs: {{tool: {{create_kwargs: ...}}}}) or null, "
                            f"got {type(extra_info).__name__}")
        try:
            parse_tools_kwargs((extra_info or {}).get("tools_kwargs"), self.tools or ())
        except ValueError as exc:
            raise row_error(*self.locate(global_row), EXTRA_INFO, str(exc)) from None

    def render(self, global_row: int, prompt: Any) -> str:
        """The validated prompt as the model sees it; DataError naming file, row and the prompt column
        when the chat template refuses it."""
        try:
            return self.renderer.text(prompt)
        except ChatTemplateError as exc:
            raise row_error(*self.locate(global_row), self.prompt_key,
                            f"chat template: {exc} (the tokenizer's chat template refuses this prompt; write the "
                            "row as it accepts, or leave such rows out with skip_bad_rows)") from None

    def __call__(self, *columns: list[Any]) -> dict[str, list[Any]]:
        """``prompt_length`` of each row (BAD_ROW_LENGTH for a skipped row) and ``problem`` ("" or
        the skipped row's error)."""
        prompts, sources, rows = columns[0], columns[1], columns[-1]
        more = iter(columns[2:-1])
        reward_models = next(more) if self.has_reward_model else [None] * len(rows)
        extra_infos = next(more) if self.reads_extra_info else [None] * len(rows)
        texts: list[str | None] = []
        problems = []
        for r, p, s, m, e in zip(rows, prompts, sources, reward_models, extra_infos):
            try:
                texts.append(self.render(r, self.check(r, p, s, m, e)))  # each prompt rendered once
                problems.append("")
            except DataError as exc:
                if not self.skip_bad_rows:
                    raise
                texts.append(None)
                problems.append(str(exc))
        measured = iter(self.renderer.text_lengths([t for t in texts if t is not None]))
        return {
            "prompt_length": [BAD_ROW_LENGTH if t is None else next(measured) for t in texts],
            "problem": problems,
        }
