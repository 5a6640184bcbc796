"""Built-in scorers on hand-written positive and negative cases, tricky formats included."""

from __future__ import annotations

import pytest

from megarl.errors import ConfigError
from megarl.rewards.scorers import (
    DATA_SOURCE_SCORERS,
    UnknownDataSourceError,
    arithmetic,
    check_scorer_options,
    countdown,
    gsm8k,
    math,
    math_dapo,
    score_builtin,
)

pytestmark = pytest.mark.unit


# ----- gsm8k ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "truth"),
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
        ("#### 1,000", "1000"),
        ("####72", "72"),
        ("#### $72", "72"),
        ("#### 72.00", "72"),
        ("#### 5 is wrong, really #### 6", "6"),  # the last #### counts
        ("#### -3", "-3"),
        ("#### 0.5", ".5"),
    ],
)
def test_gsm8k_strict_correct(text: str, truth: str) -> None:
    assert gsm8k.compute_score(text, truth) == {"score": 1.0, "acc": 1.0, "format": 1.0}


@pytest.mark.parametrize(
    ("text", "truth", "expected_format"),
    [
        ("The answer is 72", "72", 0.0),  # strict needs ####
        ("#### 73", "72", 1.0),
        ("#### 7.2", "72", 1.0),
        ("####", "72", 0.0),
        ("#### 3", "-3", 1.0),
        ("", "0", 0.0),
    ],
)
def test_gsm8k_strict_wrong(text: str, truth: str, expected_format: float) -> None:
    result = gsm8k.compute_score(text, truth, format_score=0.1)
    assert result["acc"] == 0.0 and result["format"] == expected_format
    assert result["score"] == (0.1 if expected_format else 0.0)


def test_gsm8k_flexible_takes_the_last_number() -> None:
    assert gsm8k.compute_score("so the answer is 72.", "72", method="flexible")["score"] == 1.0
    assert gsm8k.compute_score("72 apples, then 5 more", "72", method="flexible")["score"] == 0.0
    assert gsm8k.compute_score("it costs $1,250 in total", "1250", method="flexible")["score"] == 1.0
    assert gsm8k.compute_score("no numbers here", "1", method="flexible") == {
        "score": 0.0,
        "acc": 0.0,
        "format": 0.0,
    }
    with pytest.raises(ValueError, match="method"):
        gsm8k.compute_score("1", "1", method="loose")


# ----- math ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{\\sqrt{\\frac{a}{b}}}", "\\sqrt{\\frac{a}{b}}"),
        ("answer: \\boxed 5$ done", "5"),
        ("\\fbox{3}", "3"),
        ("\\boxed{\\text{(A)}}", "\\text{(A)}"),
        ("no box", None),
        ("\\boxed{unbalanced", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert math.extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("predicted", "truth"),
    [
        ("\\frac12", "\\frac{1}{2}"),
        ("0.5", "\\frac{1}{2}"),
        ("1/2", "\\dfrac{1}{2}"),
        ("\\tfrac{3}{4}", "0.75"),
        ("-\\frac{3}{4}", "-0.75"),
        ("x = 3", "3"),
        ("3.0", "3"),
        ("10\\%", "10"),
        ("5\\text{ cm}", "5"),
        ("1,000", "1000"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("90^\\circ", "90"),
        ("\\$5", "5"),
        ("\\sqrt2", "\\sqrt{2}"),
        (".5", "0.5"),
        ("\\text{Monday}", "Monday"),
        ("2\\sqrt{3}", "2 \\sqrt{3}"),
    ],
)
def test_math_equivalent(predicted: str, truth: str) -> None:
    assert math.is_equivalent(predicted, truth)
    assert math.compute_score(f"Thus $\\boxed{{{predicted}}}$.", truth)["score"] == 1.0


@pytest.mark.parametrize(
    ("predicted", "truth"),
    [
        ("\\frac{1}{3}", "0.33"),
        ("(1,2)", "(2,1)"),
        ("2", "-2"),
        ("\\sqrt{2}", "2"),
        ("12", "1,2"),
        ("\\frac{1}{0}", "0"),
        ("x^2", "x^3"),
    ],
)
def test_math_not_equivalent(predicted: str, truth: str) -> None:
    assert not math.is_equivalent(predicted, truth)
    result = math.compute_score(f"\\boxed{{{predicted}}}", truth, format_score=0.1)
    assert result == {"score": 0.1, "acc": 0.0, "format": 1.0}


def test_math_ground_truth_may_be_a_boxed_solution() -> None:
    assert math.compute_score("\\boxed{4}", "We get $\\boxed{4}$.")["score"] == 1.0
    assert math.compute_score("The answer is 4", "4") == {"score": 0.0, "acc": 0.0, "format": 0.0}


# ----- countdown -----------------------------------------------------------------------------

TRUTH = {"target": 22, "numbers": [3, 5, 7]}


@pytest.mark.parametrize(
    "text",
    [
        "3*5+7",
        " 3 * 5 + 7 ",
        "<answer>(3*5)+7</answer>",
        "thinking...<answer>7+5*3</answer>",
        "3*5+7 = 22",
        "3*5+7.",
        "3*5+7\nbecause",
    ],
)
def test_countdown_correct(text: str) -> None:
    assert countdown.compute_score(text, TRUTH) == {"score": 1.0, "acc": 1.0, "format": 1.0}


@pytest.mark.parametrize(
    "text",
    [
        "3*5+5",  # 5 used twice
        "3*5+8-1",  # numbers not given
        "3+5+7",  # wrong value
        "7/(5-5)",  # division by zero
        "22",  # a number not given
    ],
)
def test_countdown_well_formed_but_wrong(text: str) -> None:
    assert countdown.compute_score(text, TRUTH) == {"score": 0.1, "acc": 0.0, "format": 1.0}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   \n  ",
        "__import__('os').system('true')",
        "2**3",
        "3.5*4",
        "abs(-22)",
        "x+1",
        "'22'",
        "3*5+7;",
        "[22]",
        "(" * 300 + "1" + ")" * 300,
    ],
)
def test_countdown_malformed(text: str) -> None:
    assert countdown.compute_score(text, TRUTH) == {"score": 0.0, "acc": 0.0, "format": 0.0}


def test_countdown_exact_division_and_options() -> None:
    assert countdown.compute_score("7/2*4", {"target": 14, "numbers": [7, 2, 4]})["score"] == 1.0
    assert countdown.compute_score("7/2", {"target": 3, "numbers": [7, 2]})["score"] == 0.1  # 3.5, not 3
    assert countdown.compute_score("-3+5*5", {"target": 22, "numbers": [3, 5, 5]})["score"] == 1.0
    assert countdown.compute_score("5*5-3", {"target": 22, "numbers": [3, 5, 5, 9]})["score"] == 1.0
    assert (
        countdown.compute_score("5*5-3", {"target": 22, "numbers": [3, 5, 5, 9]}, require_all_numbers=True)[
            "score"
        ]
        == 0.1
    )
    assert countdown.compute_score("3+5", {"target": 1, "numbers": [3]}, format_score=0.0)["score"] == 0.0


# ----- arithmetic ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "truth", "prefix", "exact", "well_formed"),
    [
        ("7", "7", 1, 1, 1),
        (" 7 \n", "7", 1, 1, 1),
        ("7+1", "7", 1, 0, 0),
        ("7 is it", "7", 1, 0, 0),
        ("72", "7", 0, 0, 1),
        ("07", "7", 0, 0, 1),
        ("-3", "-3", 1, 1, 1),
        ("3", "-3", 0, 0, 1),
        ("abc", "7", 0, 0, 0),
        ("", "0", 0, 0, 0),
        ("1000", "1000", 1, 1, 1),
    ],
)
def test_arithmetic_modes(text: str, truth: str, prefix: int, exact: int, well_formed: int) -> None:
    assert arithmetic.compute_score(text, truth) == {"score": prefix, "acc": prefix, "format": well_formed}
    assert arithmetic.compute_score(text, truth, mode="exact") == {
        "score": exact,
        "acc": exact,
        "format": well_formed,
    }


# ----- dispatch ------------------------------------------------------------------------------


def test_dispatch_by_data_source() -> None:
    assert score_builtin("openai/gsm8k", "#### 4", "4")["score"] == 1.0
    assert score_builtin("lighteval/MATH", "\\boxed{4}", "4")["score"] == 1.0
    assert score_builtin("DigitalLearningGmbH/MATH-lighteval", "\\boxed{4}", "4")["score"] == 1.0
    assert score_builtin("countdown", "3*5+7", TRUTH)["score"] == 1.0
    assert score_builtin("arithmetic", "7+", "7", options={"arithmetic": {"mode": "exact"}})["score"] == 0.0
    with pytest.raises(UnknownDataSourceError, match="'my/data'.*known data sources: .*'openai/gsm8k'"):
        score_builtin("my/data", "1", "1")
    assert {"openai/gsm8k", "math", "countdown", "arithmetic"} <= set(DATA_SOURCE_SCORERS)


@pytest.mark.parametrize(("response", "truth", "score", "found"), [
    ("Let me think.\nAnswer: 34", "34", 1.0, 1.0),
    ("so the sum is 1/2.\nanswer:  $\\frac{1}{2}$.", "0.5", 1.0, 1.0),
    ("Answer: 3\nwait, no.\nAnswer: \\boxed{12}", "12", 1.0, 1.0),  # the last answer line counts
    ("Answer: 35", "34", -1.0, 1.0),
    ("The answer is \\boxed{34}", "34", -1.0, 0.0),  # no answer line: DAPO's prompts ask for one
])
def test_math_dapo_reads_the_last_answer_line(response: str, truth: str, score: float, found: float) -> None:
    result = math_dapo.compute_score(response, truth)
    assert result == {"score": score, "acc": float(score > 0), "format": found}


def test_math_dapo_searches_the_end_of_the_response() -> None:
    late = "Answer: 34\n" + "padding " * 50
    assert math_dapo.compute_score(late, "34")["format"] == 0.0
    assert math_dapo.compute_score(late, "34", tail_chars=0)["score"] == 1.0  # 0: the whole response
    # DAPO-Math-17k and AIME sets (verl's "aime" prefix rule) go to it
    for source in ("math_dapo", "BytedTsinghua-SIA/DAPO-Math-17k", "aime-2024", "AIME2025"):
        assert score_builtin(source, "Answer: 7", "7")["score"] == 1.0, source


def test_scorer_options_are_checked() -> None:
    check_scorer_options({"arithmetic": {"mode": "exact"}, "countdown": {"format_score": 0.0}})
    with pytest.raises(ConfigError, match="'gsm9k' is not a built-in scorer"):
        check_scorer_options({"gsm9k": {}})
    with pytest.raises(ConfigError, match="reward_kwargs.countdown"):
        check_scorer_options({"countdown": {"bonus": 1}})
    # Values, before any worker starts (the scorer itself would raise at every call).
    check_scorer_options({"gsm8k": {"method": "flexible", "correct_score": 2}, "countdown": {"require_all_numbers": True},
                          "math_dapo": {"tail_chars": 500}})
    for options, message in [
        ({"arithmetic": {"mode": "exakt"}}, "reward_kwargs.arithmetic.mode = 'exakt'; valid: ['prefix', 'exact', 'startswith']"),
        ({"gsm8k": {"method": "strct"}}, "reward_kwargs.gsm8k.method = 'strct'; valid: ['strict', 'flexible']"),
        ({"math": {"format_score": "0.1"}}, "reward_kwargs.math.format_score = '0.1'; valid: a number"),
        ({"countdown": {"require_all_numbers": "yes"}}, "reward_kwargs.countdown.require_all_numbers = 'yes'; valid: true or false"),
        ({"math_dapo": {"tail_chars": "300"}}, "reward_kwargs.math_dapo.tail_chars = '300'; valid: an integer"),
        ({"math_dapo": {"tail_chars": True}}, "reward_kwargs.math_dapo.tail_chars = True; valid: an integer"),
        ({"math_dapo": {"tail_chars": 300.0}}, "reward_kwargs.math_dapo.tail_chars = 300.0; valid: an integer"),
    ]:
        with pytest.raises(ConfigError) as err:
            check_scorer_options(options)
        assert message in str(err.value)


# ----- adversarial completions ---------------------------------------------------------------

ADVERSARIAL = [
    ("openai/gsm8k", "1" * 100_000, "1"),  # beyond Python's int parsing limit
    ("openai/gsm8k", "####" + " " * 100_000 + "x", "1"),
    ("openai/gsm8k", "#### " * 20_000, "1"),
    ("math", "\\boxed{\\frac{" + "1" * 5000 + "}{2}}", "1"),
    ("math", "\\boxed{" + "\\text{a}" * 20_000 + "}", "1"),
    ("math", "\\boxed{" + "{" * 20_000 + "}" * 20_000 + "}", "1"),
    ("math", "\\boxed{" * 20_000, "1"),
    ("countdown", "<answer>" * 50_000 + "</answer>", {"target": 1, "numbers": [1]}),
    ("countdown", "(" * 120 + "1" + ")" * 120, {"target": 1, "numbers": [1]}),
    ("arithmetic", "7" * 100_000, "7"),
]


@pytest.mark.timeout(30)  # a quadratic regex or parser here takes minutes on these inputs
@pytest.mark.parametrize(("source", "text", "truth"), ADVERSARIAL)
def test_huge_or_pathological_completions_score_quickly_without_errors(
    source: str, text: str, truth: object
) -> None:
    result = score_builtin(source, text, truth)
    assert set(result) == {"score", "acc", "format"}
    assert result["score"] in (0.0, 0.1, 1.0)
