"""DAPO-Math-style answers: the response's last line of the form ``Answer: X`` (what the prompts of
DAPO-Math-17k ask for), compared with the ground truth as MATH answers are (`math.is_equivalent`).

As in DAPO's recipe the reward is +1 for a correct answer and -1 otherwise, a missing answer line
included; only the end of the response is searched (``tail_chars``), where the prompt asks for the
line.
"""

from __future__ import annotations

import re
from typing import Any

from megarl.rewards.scorers.math import extract_boxed, is_equivalent

_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)


def extract_answer_line(text: str, tail_chars: int = 300) -> str | None:
    """The text after the last ``Answer:`` in the last ``tail_chars`` characters (a boxed answer in it
    unwrapped, surrounding ``$`` and a final period removed); None without one."""
    matches = _ANSWER_LINE.findall(text[-tail_chars:] if tail_chars > 0 else text)
    if not matches:
        return None
    answer = matches[-1].strip()
    answer = extract_boxed(answer) or answer
    answer = answer.strip().rstrip(".").strip()
    if len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
        answer = answer.strip("$").strip()
    return answer or None


def compute_score(
    solution_str: str,
    ground_truth: Any,
    *,
    correct_score: float = 1.0,
    incorrect_score: float = -1.0,
    tail_chars: int = 300,
) -> dict[str, float]:
    """``correct_score`` when the last answer line is equivalent to the ground truth, else
    ``incorrect_score``; ``format``: whether an answer line was found."""
    predicted = extract_answer_line(solution_str, tail_chars)
    correct = predicted is not None and is_equivalent(predicted, str(ground_truth))
    return {"score": correct_score if correct else incorrect_score, "acc": float(correct),
            "format": float(predicted is not None)}
