"""Truncation modes and left padding on hand-worked examples."""

from __future__ import annotations

import pytest
import torch

from megarl.data.padding import PromptTooLongError, left_pad, truncate_ids

pytestmark = pytest.mark.unit

TEN = list(range(1, 11))


@pytest.mark.parametrize(
    ("mode", "max_length", "expected"),
    [
        ("left", 4, [7, 8, 9, 10]),
        ("right", 4, [1, 2, 3, 4]),
        ("middle", 4, [1, 2, 9, 10]),
        ("middle", 5, [1, 2, 8, 9, 10]),  # head gets floor(5/2), tail the rest
        ("middle", 1, [10]),
        ("left", 10, TEN),
    ],
)
def test_truncation_modes(mode: str, max_length: int, expected: list[int]) -> None:
    assert truncate_ids(TEN, max_length, mode) == expected


@pytest.mark.parametrize("mode", ["error", "left", "right", "middle"])
def test_short_prompts_are_untouched(mode: str) -> None:
    assert truncate_ids([5, 6], 4, mode) == [5, 6]


def test_error_mode_raises_with_lengths() -> None:
    with pytest.raises(PromptTooLongError, match="10 tokens, more than max_prompt_length=4"):
        truncate_ids(TEN, 4, "error")


def test_unknown_mode_and_bad_length() -> None:
    with pytest.raises(ValueError, match="'top'"):
        truncate_ids(TEN, 4, "top")
    with pytest.raises(ValueError, match=">= 1"):
        truncate_ids(TEN, 0, "left")


def test_left_pad_fixed_length() -> None:
    input_ids, mask, positions = left_pad([[5, 6, 7], [8], []], pad_token_id=0, length=4)
    assert input_ids.tolist() == [[0, 5, 6, 7], [0, 0, 0, 8], [0, 0, 0, 0]]
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert positions.tolist() == [[0, 0, 1, 2], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert input_ids.dtype == mask.dtype == positions.dtype == torch.int64


def test_left_pad_to_longest_with_nonzero_pad() -> None:
    input_ids, mask, positions = left_pad([[5, 6], [7, 8, 9]], pad_token_id=99)
    assert input_ids.tolist() == [[99, 5, 6], [7, 8, 9]]
    assert mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert positions.tolist() == [[0, 0, 1], [0, 1, 2]]


def test_left_pad_refuses_a_sequence_longer_than_length() -> None:
    with pytest.raises(ValueError, match="3 tokens does not fit into length 2"):
        left_pad([[1, 2, 3]], pad_token_id=0, length=2)
