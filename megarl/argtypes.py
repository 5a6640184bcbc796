"""argparse value types shared by the `megarl` subcommands: a bad value is a usage error (exit 2,
one line naming the option and what would be valid) before anything is read or written."""

from __future__ import annotations

import argparse
from typing import Callable


def positive_int(what: str, hint: str = "") -> Callable[[str], int]:
    """The type of an option whose value is an integer >= 1 (`what` names it in the message, e.g.
    "number of rows"; `hint` follows the valid range)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {what}; valid: an integer >= 1{hint}")
        return value

    return parse
