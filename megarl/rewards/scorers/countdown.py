"""Countdown: the completion is an expression over the given numbers that must equal the target."""

from __future__ import annotations

from collections import Counter
from typing import Any

from megarl.rewards.scorers.expression import ExpressionError, evaluate, integer_literals, parse_expression

_OPEN_TAG, _CLOSE_TAG = "<answer>", "</answer>"


def extract_expression(solution_str: str) -> str | None:
    """The expression: inside the last ``<answer>...</answer>`` if present, else the first non-empty
    line; a trailing ``= value`` and a final period are dropped."""
    # str.rfind, not a regex: a lazy ".*?" between tags is quadratic on text with many open tags.
    close = solution_str.rfind(_CLOSE_TAG)
    open_ = solution_str.rfind(_OPEN_TAG, 0, close) if close >= 0 else -1
    if open_ >= 0:
        text = solution_str[open_ + len(_OPEN_TAG) : close]
    else:
        text = next((line for line in solution_str.splitlines() if line.strip()), "")
    text = text.split("=")[0].strip().rstrip(".").strip()
    return text or None


def compute_score(
    solution_str: str,
    ground_truth: Any,
    *,
    format_score: float = 0.1,
    correct_score: float = 1.0,
    require_all_numbers: bool = False,
) -> dict[str, float]:
    """Score one completion against ``ground_truth = {"target": int, "numbers": [int, ...]}``.

    ``correct_score`` when the expression uses only the given numbers, each at most as often as
    given (all of them when ``require_all_numbers``), and its exact value equals the target;
    ``format_score`` for any other well-formed expression (wrong value, wrong numbers, division by
    zero); 0 when there is no expression or it uses anything besides integers, + - * / and
    parentheses.
    """
    target, numbers = ground_truth["target"], [int(n) for n in ground_truth["numbers"]]
    expression = extract_expression(solution_str)
    if expression is None:
        return {"score": 0.0, "acc": 0.0, "format": 0.0}
    try:
        tree = parse_expression(expression)
    except ExpressionError:
        return {"score": 0.0, "acc": 0.0, "format": 0.0}
    used, available = Counter(integer_literals(tree)), Counter(numbers)
    numbers_ok = used == available if require_all_numbers else not (used - available)
    try:
        correct = numbers_ok and evaluate(tree) == int(target)
    except ExpressionError:  # division by zero: well-formed, wrong
        correct = False
    return {"score": correct_score if correct else format_score, "acc": float(correct), "format": 1.0}
