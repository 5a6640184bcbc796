"""Arithmetic: the completion is the answer, a bare integer (the quickstart's task)."""

from __future__ import annotations

import re
from typing import Any

_INTEGER_RE = re.compile(r"-?\d+")
MODES = ("prefix", "exact", "startswith")


def compute_score(solution_str: str, ground_truth: Any, *, mode: str = "prefix") -> dict[str, float]:
    """1 when the stripped completion's answer equals ``ground_truth``, else 0.

    ``exact``: the stripped completion is exactly the integer. ``prefix``: the completion starts
    with the integer, and the number there ends where the answer ends ("7", "7 " and "7+1" answer
    7; "72" and "07" do not). ``startswith``: the completion's text starts with the answer's digits
    ("7", "72" and "7+1" answer 7: the densest signal, used by the CPU quickstart to learn from a
    random init). ``format`` is 1 when the stripped completion is a bare integer.
    """
    if mode not in MODES:
        raise ValueError(f"arithmetic mode must be one of {list(MODES)}, got {mode!r}")
    text = solution_str.strip()
    expected = str(int(str(ground_truth).strip()))  # canonical: no sign on 0, no leading zeros
    well_formed = _INTEGER_RE.fullmatch(text) is not None
    if mode == "exact":
        correct = text == expected
    elif mode == "startswith":
        correct = text.startswith(expected)
    else:
        leading = _INTEGER_RE.match(text)
        correct = leading is not None and leading.group() == expected
    return {"score": float(correct), "acc": float(correct), "format": float(well_formed)}
