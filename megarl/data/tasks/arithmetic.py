"""Synthetic arithmetic: "3+4=" -> "7". Difficulty is set by operand count, value range and operators.

The quickstart's task (`make demo`: two operands 0..4, ``+``) is easy enough for a randomly
initialised 4-layer model to learn with GRPO on CPU in about a hundred steps;
:meth:`ArithmeticTask.single_digit_addition` (operands 0..9) is harder. The prompt
is the bare expression followed by ``=``; the expected completion is the number, then EOS.
Operators follow the usual precedence (``*`` before ``+``/``-``, left to right).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from megarl.data.tasks.rows import verl_row
from megarl.errors import ConfigError

DATA_SOURCE = "arithmetic"
OPERATORS = "+-*"


def evaluate_left_to_right_with_precedence(operands: list[int], operators: list[str]) -> int:
    """Value of ``o0 op0 o1 op1 o2 ...`` with ``*`` binding tighter than ``+`` and ``-``."""
    terms = [operands[0]]  # signed summands; a '*' multiplies into the last one
    for op, value in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= value
        elif op == "+":
            terms.append(value)
        else:
            terms.append(-value)
    return sum(terms)


@dataclass(frozen=True)
class ArithmeticTask:
    """Expressions of ``num_operands`` integers drawn uniformly from [min_value, max_value]."""

    num_operands: int = 2
    min_value: int = 0
    max_value: int = 9
    operators: str = "+"
    allow_negative_results: bool = True
    spaces: bool = False  # "3 + 4 =" instead of "3+4="

    def __post_init__(self) -> None:
        if self.num_operands < 2:
            raise ConfigError(f"arithmetic: num_operands must be >= 2, got {self.num_operands}")
        if not 0 <= self.min_value <= self.max_value:
            raise ConfigError(
                f"arithmetic: need 0 <= min_value <= max_value, got [{self.min_value}, {self.max_value}]"
            )
        if not self.operators or set(self.operators) - set(OPERATORS):
            raise ConfigError(
                f"arithmetic: operators must be a non-empty subset of '{OPERATORS}', got {self.operators!r}"
            )

    @classmethod
    def single_digit_addition(cls) -> ArithmeticTask:
        """a+b= with a, b in 0..9 (100 distinct prompts; answers 0..18)."""
        return cls(num_operands=2, min_value=0, max_value=9, operators="+")

    def alphabet(self) -> str:
        """Every character a prompt or a correct answer can contain, and a space (models emit them;
        with ``spaces`` prompts contain them). A negative answer's sign is the '-' operator."""
        return "0123456789" + self.operators + "= "

    def sample(self, rng: random.Random) -> tuple[str, int]:
        """One (prompt, answer) pair."""
        for _ in range(10_000):
            operands = [rng.randint(self.min_value, self.max_value) for _ in range(self.num_operands)]
            ops = [rng.choice(self.operators) for _ in range(self.num_operands - 1)]
            answer = evaluate_left_to_right_with_precedence(operands, ops)
            if answer >= 0 or self.allow_negative_results:
                break
        else:  # pragma: no cover - needs an operator mix that is almost never non-negative
            raise ConfigError("arithmetic: could not draw a non-negative result; allow negative results")
        joiner = " " if self.spaces else ""
        parts = [str(operands[0])]
        for op, value in zip(ops, operands[1:]):
            parts += [op, str(value)]
        return joiner.join(parts + ["="]), answer

    def rows(self, num_rows: int, seed: int, split: str) -> Iterator[dict[str, Any]]:
        """``num_rows`` rows in verl's layout; the same (seed, split) gives the same rows."""
        rng = random.Random(f"arithmetic:{seed}:{split}")
        for index in range(num_rows):
            prompt, answer = self.sample(rng)
            yield verl_row(
                data_source=DATA_SOURCE,
                content=prompt,
                ground_truth=str(answer),
                ability="arithmetic",
                split=split,
                index=index,
            )
