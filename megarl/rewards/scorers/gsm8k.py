"""GSM8K: the final answer is a number, written after ``####`` (strict) or anywhere last (flexible)."""

from __future__ import annotations

import re
from typing import Any

from megarl.rewards.scorers.numbers import NUMBER_PATTERN, parse_number

_STRICT_RE = re.compile(rf"####\s*({NUMBER_PATTERN})")
_ANY_NUMBER_RE = re.compile(NUMBER_PATTERN)
METHODS = ("strict", "flexible")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer text: after the last ``####`` (strict) or the last number in the text (flexible)."""
    if method not in METHODS:
        raise ValueError(f"gsm8k method must be one of {list(METHODS)}, got {method!r}")
    if method == "strict":
        found = [m for m in _STRICT_RE.findall(solution_str) if re.search(r"\d", m)]
    else:
        found = [m for m in _ANY_NUMBER_RE.findall(solution_str) if re.search(r"\d", m)]
    return found[-1] if found else None


def compute_score(
    solution_str: str,
    ground_truth: Any,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> dict[str, float]:
    """``correct_score`` when the extracted number equals the ground truth (exact value: "1,000" ==
    "1000.0"), ``format_score`` when a number was extracted but differs, 0 when none was found."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return {"score": 0.0, "acc": 0.0, "format": 0.0}
    predicted, expected = parse_number(answer), parse_number(str(ground_truth))
    correct = predicted is not None and predicted == expected
    return {"score": correct_score if correct else format_score, "acc": float(correct), "format": 1.0}
