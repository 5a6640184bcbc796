"""Arithmetic with a calculator tool: "483920+771035=" where calling the calculator is the way to be right.

The operands are large enough that a tiny model cannot compute the sum, but it can copy the
expression into a calculator call and then copy the tool's answer. One episode, in ChatML:

    <|im_start|>user\\n483920+771035=<|im_end|>\\n<|im_start|>assistant\\n
    <tool_call>{"name": "calculator", "arguments": {"expression": "483920+771035"}}</tool_call><|im_end|>
    \\n<|im_start|>tool\\n1254955<|im_end|>\\n<|im_start|>assistant\\n
    1254955<|im_end|>

The tokenizer (`build_tools_tokenizer`) is character level, with the ChatML markers and the
tool-call tags as special tokens and the JSON around the expression as two single tokens, so a call
is the expression plus five tokens. Rows carry `extra_info.tools_kwargs.calculator.create_kwargs.ground_truth`
(the calculator's `calc_reward` is 1 when its last result is the answer); the rule score
(data source `arithmetic_tools`, the gsm8k scorer's `flexible` method) reads the last number of the
model's turns.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.data.tasks.arithmetic import evaluate_left_to_right_with_precedence
from megarl.data.tasks.rows import verl_row
from megarl.data.tokenizer import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, build_char_tokenizer
from megarl.errors import ConfigError

DATA_SOURCE = "arithmetic_tools"
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")
CALL_HEAD = '{"name": "calculator", "arguments": {"expression": "'
CALL_TAIL = '"}}'
TOOLS_ALPHABET = string.digits + "+-*=/()., \n" + string.ascii_lowercase + '{}":_'


@dataclass(frozen=True)
class ArithmeticToolsTask:
    """Expressions of two operands with `digits` digits each, joined by one of `operators`."""

    digits: int = 6
    operators: str = "+"

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ConfigError(f"arithmetic_tools: digits must be >= 1, got {self.digits}")
        if not self.operators or set(self.operators) - set("+-*"):
            raise ConfigError(f"arithmetic_tools: operators must be a non-empty subset of '+-*', got {self.operators!r}")

    def sample(self, rng: random.Random) -> tuple[str, int]:
        low, high = 10 ** (self.digits - 1) if self.digits > 1 else 0, 10 ** self.digits - 1
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(self.operators)
        return f"{a}{op}{b}", evaluate_left_to_right_with_precedence([a, b], [op])

    def rows(self, num_rows: int, seed: int, split: str) -> Iterator[dict[str, Any]]:
        rng = random.Random(f"arithmetic_tools:{seed}:{split}")
        for index in range(num_rows):
            expression, answer = self.sample(rng)
            yield verl_row(data_source=DATA_SOURCE, content=expression + "=", ground_truth=str(answer),
                           ability="arithmetic", split=split, index=index,
                           tools_kwargs={"calculator": {"create_kwargs": {"ground_truth": str(answer)}}})


def call_text(expression: str) -> str:
    """The model's turn that calls the calculator (ends on the turn's EOS)."""
    return f"{TOOL_CALL_TOKENS[0]}{CALL_HEAD}{expression}{CALL_TAIL}{TOOL_CALL_TOKENS[1]}<|im_end|>"


def build_tools_tokenizer(out_dir: str | Path) -> Any:
    """Character tokenizer with ChatML (EOS `<|im_end|>`), the tool-call tags as special tokens and
    `CALL_HEAD` / `CALL_TAIL` as single (non-special, so they decode into the text) tokens; saved to `out_dir`."""
    tokenizer = build_char_tokenizer(TOOLS_ALPHABET, out_dir, chat_template=CHATML_TEMPLATE,
                                     extra_special_tokens=(*CHATML_SPECIAL_TOKENS, *TOOL_CALL_TOKENS))
    tokenizer.add_tokens([CALL_HEAD, CALL_TAIL])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer
