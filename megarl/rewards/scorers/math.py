"""MATH-style answers: the last ``\\boxed{...}`` compared after normalising simple LaTeX.

Two answers are equivalent when their normalised strings are equal, or when both are numbers
(integers, decimals, ``a/b``, ``\\frac{a}{b}``, with thousands separators, percent signs, units in
``\\text{}`` and ``x =`` prefixes removed) with the same exact value.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from megarl.rewards.scorers.numbers import parse_number

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _braced(text: str, open_at: int) -> str | None:
    """The content of the brace group opening at ``text[open_at] == '{'`` (nested braces allowed)."""
    depth = 0
    for position in range(open_at, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : position]
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed x``); None when absent."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = start + len(command)
    if rest < len(text) and text[rest] == "{":
        return _braced(text, rest)
    if rest < len(text) and text[rest] == " ":  # "\boxed 5": up to the next space or '$'
        return re.split(r"[\s$]", text[rest + 1 :].lstrip(), maxsplit=1)[0] or None
    return None


_WRAPPERS = ("\\text", "\\textbf", "\\mbox", "\\mathrm", "\\mathbf")


def _unwrap_commands(text: str) -> str:
    r"""``\text{abc}`` -> ``abc`` for every wrapper command, nested ones too, in one pass."""
    out: list[str] = []
    drop_closer: list[bool] = []  # one entry per open brace: is its closing brace dropped?
    position = 0
    while position < len(text):
        if text[position] == "\\":
            wrapper = next((w for w in _WRAPPERS if text.startswith(w + "{", position)), None)
            if wrapper is not None:
                drop_closer.append(True)
                position += len(wrapper) + 1
                continue
        char = text[position]
        position += 1
        if char == "{":
            drop_closer.append(False)
        elif char == "}" and drop_closer and drop_closer.pop():
            continue
        out.append(char)
    return "".join(out)


def _brace_single_arguments(text: str, command: str, arity: int) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\sqrt3`` -> ``\sqrt{3}``: brace single-character arguments."""
    out = []
    pieces = text.split(command)
    out.append(pieces[0])
    for piece in pieces[1:]:
        rebuilt, rest = "", piece
        for _ in range(arity):
            if rest.startswith("{"):
                inner = _braced(rest, 0)
                if inner is None:
                    break
                rebuilt += "{" + inner + "}"
                rest = rest[len(inner) + 2 :]
            elif rest:
                rebuilt += "{" + rest[0] + "}"
                rest = rest[1:]
        out.append(command + rebuilt + rest)
    return "".join(out)


def normalize_answer(answer: str) -> str:
    """A canonical string for simple LaTeX answers (whitespace-free)."""
    s = answer.strip()
    for old, new in (
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\displaystyle", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
        ("$", ""),
        ("\\%", ""),
        ("%", ""),
        ("{,}", ","),
    ):
        s = s.replace(old, new)
    s = re.sub(
        r"\\(?:text|textbf|mbox|mathrm)\{\s*(?:units?|cm|m|km|kg|g|degrees?|inches|feet|dollars|cents)\s*\}$",
        "",
        s,
    )
    s = _unwrap_commands(s)
    s = re.sub(r"\s+", "", s)
    # "x=5" or "k=5" -> "5" (a short variable name on the left)
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    s = _brace_single_arguments(s, "\\frac", 2)
    s = _brace_single_arguments(s, "\\sqrt", 1)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d+/\d+", s):
        numerator, denominator = s.split("/")
        s = f"\\frac{{{numerator}}}{{{denominator}}}"
    if s.startswith("."):
        s = "0" + s
    elif s.startswith("-."):
        s = "-0" + s[1:]
    return s


def _as_value(normalized: str) -> Fraction | None:
    frac = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", normalized)
    if not frac:
        return parse_number(normalized)
    try:
        numerator, denominator = Fraction(frac.group(2)), Fraction(frac.group(3))
    except ValueError:  # thousands of digits exceed Python's int parsing limit: not an answer
        return None
    if denominator == 0:
        return None
    return -numerator / denominator if frac.group(1) else numerator / denominator


def is_equivalent(predicted: str, expected: str) -> bool:
    """Whether two answers mean the same (normalised strings equal, or equal exact numbers)."""
    a, b = normalize_answer(predicted), normalize_answer(expected)
    if a == b:
        return True
    value_a, value_b = _as_value(a), _as_value(b)
    return value_a is not None and value_a == value_b


def compute_score(
    solution_str: str, ground_truth: Any, *, format_score: float = 0.0, correct_score: float = 1.0
) -> dict[str, float]:
    """``correct_score`` when the last boxed answer is equivalent to the ground truth (itself boxed
    or not), ``format_score`` when a boxed answer exists but differs, 0 without one."""
    predicted = extract_boxed(solution_str)
    if predicted is None:
        return {"score": 0.0, "acc": 0.0, "format": 0.0}
    expected = str(ground_truth)
    expected = extract_boxed(expected) or expected
    correct = is_equivalent(predicted, expected)
    return {"score": correct_score if correct else format_score, "acc": float(correct), "format": 1.0}
