"""Rows the run cannot use for reasons outside the prompt's own shape: a prompt the chat template
refuses (its `raise_exception`, e.g. Gemma's "System role not supported") and, in a run with
multi-turn tools, an `extra_info.tools_kwargs` that names a tool the run lacks. Both are errors naming
file, row and column (when the dataset is opened, or a row fetched), and skip_bad_rows skips them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from data_helpers import DIGITS_AND_OPS, row, write_rows
from transformers import PreTrainedTokenizerBase

from megarl.data.dataset import RLDataset
from megarl.data.tokenizer import CHATML_SPECIAL_TOKENS, build_char_tokenizer, load_tokenizer
from megarl.errors import DataError

pytestmark = pytest.mark.unit

# ChatML that refuses a system turn the way Gemma's template does.
NO_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
REFUSED = "column 'prompt': chat template: System role not supported"


@pytest.fixture(scope="module")
def no_system_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    out = tmp_path_factory.mktemp("no_system_tokenizer")
    build_char_tokenizer(DIGITS_AND_OPS + "abcdefghijklmnopqrstuvwxyz\n", out, chat_template=NO_SYSTEM_TEMPLATE,
                         extra_special_tokens=CHATML_SPECIAL_TOKENS)
    return load_tokenizer(out)


def with_system_turn(tmp_path: Path, name: str = "sys.parquet", count: int = 6, at: int = 4) -> str:
    rows = [row(f"1+{i}=", str(1 + i), index=i) for i in range(count)]
    rows[at]["prompt"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"1+{at}="}]
    return write_rows(tmp_path / name, rows)


@pytest.mark.parametrize("measured", [True, False], ids=["length-pass", "on-fetch"])
def test_a_prompt_the_chat_template_refuses_names_file_row_and_column(
    tmp_path: Path, no_system_tokenizer: PreTrainedTokenizerBase, cache_dir: str, measured: bool
) -> None:
    first = write_rows(tmp_path / "first.parquet", [row(f"2+{i}=") for i in range(3)])
    path = with_system_turn(tmp_path)
    with pytest.raises(DataError) as error:
        dataset = RLDataset([first, path], no_system_tokenizer, max_prompt_length=64,
                            filter_overlong_prompts=measured, cache_dir=cache_dir)
        assert len(dataset.get_rows([0, 1, 2, 3])) == 4  # rows before it fetch as before
        dataset.get_rows([3 + 4])
    assert f"{path}: row 4, {REFUSED}" in str(error.value)
    assert "skip_bad_rows" in str(error.value)  # what would let the run go on


def test_skip_bad_rows_skips_a_prompt_the_chat_template_refuses(
    tmp_path: Path, no_system_tokenizer: PreTrainedTokenizerBase, cache_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = with_system_turn(tmp_path)
    for measured in (True, False):  # skip_bad_rows runs the pass either way
        with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
            dataset = RLDataset(path, no_system_tokenizer, max_prompt_length=64, skip_bad_rows=True,
                                filter_overlong_prompts=measured, cache_dir=cache_dir)
        assert dataset.num_skipped_bad_rows == 1 and len(dataset) == 5
        assert [r["row"] for r in dataset.get_rows(range(len(dataset)))] == [0, 1, 2, 3, 5]
        assert f"{path}: row 4, {REFUSED}" in caplog.text


def test_each_prompt_is_rendered_once(
    tmp_path: Path, chat_tokenizer: PreTrainedTokenizerBase, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rendering row by row (to name a refused row) renders no prompt twice: once in the length pass,
    once per fetch."""
    path = write_rows(tmp_path / "ok.parquet", [row(f"1+{i}=") for i in range(7)])
    rendered: list[Any] = []
    real = chat_tokenizer.apply_chat_template

    def counting(messages: Any, *args: Any, **kwargs: Any) -> Any:
        rendered.append(messages)
        return real(messages, *args, **kwargs)

    monkeypatch.setattr(chat_tokenizer, "apply_chat_template", counting)
    dataset = RLDataset(path, chat_tokenizer, max_prompt_length=64, cache_dir=cache_dir)
    assert len(rendered) == 7
    dataset.get_rows([0, 3, 5])
    assert len(rendered) == 10


def rows_with_tools_kwargs(tmp_path: Path, name: str = "tools.parquet") -> str:
    """8 rows, each with tools_kwargs for calculator; row 6 also for a tool 'search' (the others hold
    None there, as parquet stores a key some rows lack)."""
    rows = [row(f"1+{i}=", str(1 + i), index=i) for i in range(8)]
    for i, r in enumerate(rows):
        r["extra_info"]["tools_kwargs"] = {"calculator": {"create_kwargs": {"ground_truth": str(1 + i)}},
                                           "search": {"create_kwargs": {"q": "x"}} if i == 6 else None}
    return write_rows(tmp_path / name, rows)


NOT_A_TOOL = ("column 'extra_info': tools_kwargs names tool 'search'; the run's tools (rollout.multi_turn.tools) "
              "are ['calculator']")


@pytest.mark.parametrize("measured", [True, False], ids=["length-pass", "no-length-pass"])
def test_tools_kwargs_naming_a_tool_the_run_lacks_is_refused_when_the_data_is_opened(
    tmp_path: Path, chat_tokenizer: PreTrainedTokenizerBase, cache_dir: str, measured: bool
) -> None:
    first = write_rows(tmp_path / "first.parquet", [row(f"2+{i}=") for i in range(3)])
    path = rows_with_tools_kwargs(tmp_path)
    with pytest.raises(DataError) as error:
        RLDataset([first, path], chat_tokenizer, max_prompt_length=64, tools=["calculator"],
                  filter_overlong_prompts=measured, cache_dir=cache_dir)
    assert f"{path}: row 6, {NOT_A_TOOL}" in str(error.value)
    # The run's tools include it: accepted, and the rows carry their tools_kwargs as before.
    dataset = RLDataset([first, path], chat_tokenizer, max_prompt_length=64, tools=["calculator", "search"],
                        filter_overlong_prompts=measured, cache_dir=cache_dir)
    assert dataset.get_rows([3 + 6])[0]["extra_info"]["tools_kwargs"]["search"] == {"create_kwargs": {"q": "x"}}
    # A run without tools does not read them.
    assert len(RLDataset(path, chat_tokenizer, max_prompt_length=64, filter_overlong_prompts=measured,
                         cache_dir=cache_dir)) == 8


def test_skip_bad_rows_skips_rows_whose_tools_kwargs_do_not_fit(
    tmp_path: Path, chat_tokenizer: PreTrainedTokenizerBase, cache_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = rows_with_tools_kwargs(tmp_path)
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        dataset = RLDataset(path, chat_tokenizer, max_prompt_length=64, tools=["calculator"], skip_bad_rows=True,
                            cache_dir=cache_dir)
    assert dataset.num_skipped_bad_rows == 1
    assert [r["row"] for r in dataset.get_rows(range(len(dataset)))] == [0, 1, 2, 3, 4, 5, 7]
    assert f"{path}: row 6, {NOT_A_TOOL}" in caplog.text


@pytest.mark.parametrize("measured", [True, False], ids=["length-pass", "no-length-pass"])
def test_extra_info_that_is_not_a_mapping_is_refused_in_a_run_with_tools(
    tmp_path: Path, chat_tokenizer: PreTrainedTokenizerBase, cache_dir: str, measured: bool
) -> None:
    rows = [row(f"1+{i}=") for i in range(4)]
    for i, r in enumerate(rows):
        r["extra_info"] = None if i == 1 else f"note {i}"
    path = write_rows(tmp_path / "strings.parquet", rows)
    with pytest.raises(DataError) as error:
        RLDataset(path, chat_tokenizer, max_prompt_length=64, tools=["calculator"],
                  filter_overlong_prompts=measured, cache_dir=cache_dir)
    assert f"{path}: row 0, column 'extra_info': expected a mapping (holding tools_kwargs" in str(error.value)
    assert "or null, got str" in str(error.value)
    # Null extra_info is a row without tool arguments.
    for i, r in enumerate(rows):
        r["extra_info"] = {"tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": "1"}}}} if i == 0 else None
    path = write_rows(tmp_path / "nulls.parquet", rows)
    dataset = RLDataset(path, chat_tokenizer, max_prompt_length=64, tools=["calculator"],
                        filter_overlong_prompts=measured, cache_dir=cache_dir)
    assert [r["extra_info"] for r in dataset.get_rows([1, 0])] == [
        {}, {"tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": "1"}}}}]
