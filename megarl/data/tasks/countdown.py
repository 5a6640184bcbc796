"""Synthetic countdown: reach a target with given numbers, each used at most once, and + - * /.

Every target is reachable: it is the value of a random expression over all the numbers (left to
right, exact integer division only, intermediate values non-negative). That reference expression is
kept in ``extra_info["solution"]``; any other correct expression scores the same.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from megarl.data.tasks.rows import verl_row
from megarl.errors import ConfigError

DATA_SOURCE = "countdown"
OPERATORS = "+-*/"
PROMPT_STYLES = ("compact", "verbose")


@dataclass(frozen=True)
class CountdownTask:
    """``num_numbers`` integers from [min_number, max_number]; target in [min_target, max_target].

    ``compact`` prompts read ``"3 5 7 -> 22:"`` (few distinct characters, for a character
    tokenizer); ``verbose`` prompts are an English instruction for models with a real vocabulary.
    """

    num_numbers: int = 3
    min_number: int = 1
    max_number: int = 20
    min_target: int = 1
    max_target: int = 100
    operators: str = OPERATORS
    prompt_style: str = "compact"

    def __post_init__(self) -> None:
        if self.num_numbers < 2:
            raise ConfigError(f"countdown: num_numbers must be >= 2, got {self.num_numbers}")
        if not 1 <= self.min_number <= self.max_number:
            raise ConfigError(
                f"countdown: need 1 <= min_number <= max_number, got [{self.min_number}, {self.max_number}]"
            )
        if not self.min_target <= self.max_target:
            raise ConfigError(
                f"countdown: need min_target <= max_target, got [{self.min_target}, {self.max_target}]"
            )
        if not self.operators or set(self.operators) - set(OPERATORS):
            raise ConfigError(
                f"countdown: operators must be a non-empty subset of '{OPERATORS}', got {self.operators!r}"
            )
        if self.prompt_style not in PROMPT_STYLES:
            raise ConfigError(
                f"countdown: prompt_style must be one of {list(PROMPT_STYLES)}, got {self.prompt_style!r}"
            )

    def alphabet(self) -> str:
        """Every character of a compact prompt or of an answer expression."""
        return "".join(dict.fromkeys("0123456789 ->:()" + self.operators))

    def prompt(self, numbers: list[int], target: int) -> str:
        if self.prompt_style == "compact":
            return f"{' '.join(map(str, numbers))} -> {target}:"
        ops = ", ".join(self.operators)
        return (
            f"Numbers: {numbers}. Target: {target}. Write one arithmetic expression that equals the target, "
            f"using each number at most once and only the operators {ops} and parentheses. "
            "Reply with the expression only."
        )

    def _random_solution(self, rng: random.Random, numbers: list[int]) -> tuple[str, int] | None:
        order = numbers[:]
        rng.shuffle(order)
        expression, value, compound = str(order[0]), order[0], False
        for n in order[1:]:
            allowed = [
                op for op in self.operators if (op != "/" or value % n == 0) and (op != "-" or value >= n)
            ]
            if not allowed:
                return None
            op = rng.choice(allowed)
            left = f"({expression})" if compound and op in "*/" else expression
            expression = f"{left}{op}{n}"
            value = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
            compound = True
        return expression, value

    def sample(self, rng: random.Random) -> tuple[list[int], int, str]:
        """(numbers, target, a reference solution)."""
        for _ in range(10_000):
            numbers = [rng.randint(self.min_number, self.max_number) for _ in range(self.num_numbers)]
            found = self._random_solution(rng, numbers)
            if found is not None and self.min_target <= found[1] <= self.max_target:
                return numbers, found[1], found[0]
        raise ConfigError(
            f"countdown: no target in [{self.min_target}, {self.max_target}] found for numbers in "
            f"[{self.min_number}, {self.max_number}]; widen the target range"
        )

    def rows(self, num_rows: int, seed: int, split: str) -> Iterator[dict[str, Any]]:
        """``num_rows`` rows in verl's layout; ground truth ``{"target": int, "numbers": [int]}``."""
        rng = random.Random(f"countdown:{seed}:{split}")
        for index in range(num_rows):
            numbers, target, solution = self.sample(rng)
            yield verl_row(
                data_source=DATA_SOURCE,
                content=self.prompt(numbers, target),
                ground_truth={"target": target, "numbers": numbers},
                ability="math",
                split=split,
                index=index,
                solution=solution,
            )
