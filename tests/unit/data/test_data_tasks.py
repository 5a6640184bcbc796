"""Synthetic tasks: answers are right, targets reachable, output deterministic, alphabets complete."""

from __future__ import annotations

import itertools
import re
from fractions import Fraction
from pathlib import Path

import pytest

from megarl.data.tasks import ArithmeticTask, CountdownTask
from megarl.data.tokenizer import build_char_tokenizer
from megarl.errors import ConfigError
from megarl.rewards.scorers import countdown as countdown_scorer

pytestmark = pytest.mark.unit


def content(r: dict) -> str:
    return r["prompt"][0]["content"]


def test_single_digit_addition_covers_all_pairs_with_correct_answers() -> None:
    rows = list(ArithmeticTask.single_digit_addition().rows(2000, seed=0, split="train"))
    pairs = set()
    for r in rows:
        match = re.fullmatch(r"(\d)\+(\d)=", content(r))
        assert match, content(r)
        a, b = int(match.group(1)), int(match.group(2))
        assert r["reward_model"]["ground_truth"] == str(a + b)
        pairs.add((a, b))
    assert len(pairs) == 100
    assert rows[0]["data_source"] == "arithmetic" and rows[0]["extra_info"] == {"split": "train", "index": 0}


@pytest.mark.parametrize(
    "task",
    [
        ArithmeticTask(num_operands=3, min_value=0, max_value=99, operators="+-*"),
        ArithmeticTask(num_operands=4, min_value=10, max_value=20, operators="*-", spaces=True),
        ArithmeticTask(num_operands=2, min_value=0, max_value=9, operators="-", allow_negative_results=False),
    ],
)
def test_answers_match_python_arithmetic(task: ArithmeticTask) -> None:
    for r in task.rows(300, seed=1, split="train"):
        text = content(r)
        assert text.endswith("=")
        # Python's own precedence is the independent reference (the text is generated, trusted).
        expected = eval(text[:-1])  # noqa: S307
        assert r["reward_model"]["ground_truth"] == str(expected)
        operands = [int(x) for x in re.findall(r"\d+", text)]
        assert len(operands) == task.num_operands
        assert all(task.min_value <= x <= task.max_value for x in operands)
        if not task.allow_negative_results:
            assert expected >= 0
        assert (" " in text) == task.spaces


def test_alphabet_covers_prompts_and_answers(tmp_path: Path) -> None:
    for task in (ArithmeticTask(num_operands=3, operators="+-*", spaces=True), CountdownTask(num_numbers=4)):
        tokenizer = build_char_tokenizer(task.alphabet(), tmp_path / type(task).__name__)
        for r in task.rows(200, seed=2, split="train"):
            gt = r["reward_model"]["ground_truth"]
            answer = gt if isinstance(gt, str) else r["extra_info"]["solution"]
            for text in (content(r), answer):
                assert tokenizer.unk_token_id not in tokenizer(text)["input_ids"], text


def test_rows_are_deterministic_per_seed_and_split() -> None:
    task = ArithmeticTask(num_operands=2, max_value=99)
    assert list(task.rows(50, 3, "train")) == list(task.rows(50, 3, "train"))
    assert [content(r) for r in task.rows(50, 3, "train")] != [content(r) for r in task.rows(50, 3, "val")]
    assert [content(r) for r in task.rows(50, 3, "train")] != [content(r) for r in task.rows(50, 4, "train")]


def reachable(numbers: list[int], target: int) -> bool:
    """Brute force: some subset, in some order and bracketing, with + - * / reaches the target."""

    def values(nums: tuple[Fraction, ...]) -> set[Fraction]:
        if len(nums) == 1:
            return {nums[0]}
        out = set()
        for split in range(1, len(nums)):
            for left in values(nums[:split]):
                for right in values(nums[split:]):
                    out |= {left + right, left - right, left * right}
                    if right != 0:
                        out.add(left / right)
        return out

    for size in range(1, len(numbers) + 1):
        for subset in itertools.permutations([Fraction(n) for n in numbers], size):
            if Fraction(target) in values(subset):
                return True
    return False


def test_countdown_targets_are_reachable_and_solutions_score_one() -> None:
    task = CountdownTask(num_numbers=3, min_number=1, max_number=12, min_target=5, max_target=60)
    for r in task.rows(60, seed=0, split="train"):
        gt = r["reward_model"]["ground_truth"]
        numbers, target = gt["numbers"], gt["target"]
        assert len(numbers) == 3 and all(1 <= n <= 12 for n in numbers) and 5 <= target <= 60
        assert content(r) == f"{numbers[0]} {numbers[1]} {numbers[2]} -> {target}:"
        assert reachable(numbers, target)
        solution = r["extra_info"]["solution"]
        assert Fraction(eval(solution)) == target  # noqa: S307 - generated text, trusted
        assert sorted(int(x) for x in re.findall(r"\d+", solution)) == sorted(numbers)
        assert countdown_scorer.compute_score(solution, gt)["score"] == 1.0


def test_countdown_verbose_prompt_names_numbers_and_target() -> None:
    r = next(CountdownTask(prompt_style="verbose").rows(1, seed=0, split="val"))
    gt = r["reward_model"]["ground_truth"]
    assert f"Numbers: {gt['numbers']}" in content(r) and f"Target: {gt['target']}" in content(r)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ArithmeticTask(num_operands=1),
        lambda: ArithmeticTask(min_value=5, max_value=2),
        lambda: ArithmeticTask(operators="/"),
        lambda: CountdownTask(num_numbers=1),
        lambda: CountdownTask(min_number=0),
        lambda: CountdownTask(operators="^"),
        lambda: CountdownTask(prompt_style="chatty"),
    ],
)
def test_invalid_task_options(make) -> None:
    with pytest.raises(ConfigError):
        make()


def test_unreachable_target_range_is_reported() -> None:
    task = CountdownTask(
        num_numbers=2, min_number=1, max_number=2, operators="+", min_target=50, max_target=60
    )
    with pytest.raises(ConfigError, match="widen the target range"):
        next(task.rows(1, seed=0, split="train"))
