"""Reading numbers written by people and models: "1,000", "$5", "3.50", "-2/3" (stdlib only)."""

from __future__ import annotations

import re
from fractions import Fraction

# A plain number as it appears in text: optional sign and $, digits with optional thousands commas,
# optional decimals. "1,000.5", "-$3", "72", ".5" all match.
NUMBER_PATTERN = r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?"
_NUMBER_RE = re.compile(rf"({NUMBER_PATTERN})")
_FRACTION_RE = re.compile(r"(-?\d+)\s*/\s*(\d+)")


def parse_number(text: str) -> Fraction | None:
    """The exact value of a plain number or an integer fraction ``a/b``; None when it is neither.

    Commas are read as thousands separators, a leading ``$`` is ignored. Values are exact
    (``Fraction``), so "3.0" equals "3" and "0.5" equals "1/2".
    """
    text = text.strip()  # not in the patterns: "\s*...\s*$" backtracks quadratically on blanks
    try:
        fraction = _FRACTION_RE.fullmatch(text)
        if fraction:
            denominator = int(fraction.group(2))
            return Fraction(int(fraction.group(1)), denominator) if denominator else None
        match = _NUMBER_RE.fullmatch(text)
        if not match or not re.search(r"\d", match.group(1)):
            return None
        return Fraction(match.group(1).replace(",", "").replace("$", ""))
    except ValueError:  # thousands of digits exceed Python's int parsing limit: not an answer
        return None
