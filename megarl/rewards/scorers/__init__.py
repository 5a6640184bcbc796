"""Built-in rule-based scorers, chosen per sample by its ``data_source``.

Every scorer is ``compute_score(solution_str, ground_truth, **options) -> {"score", "acc", "format"}``
and uses only the standard library, so that worker processes can import it cheaply.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from megarl.errors import ConfigError
from megarl.rewards.scorers import arithmetic, countdown, gsm8k, math, math_dapo

ScorerFn = Callable[..., dict[str, float]]

SCORERS: dict[str, ScorerFn] = {
    "gsm8k": gsm8k.compute_score,
    "math": math.compute_score,
    "math_dapo": math_dapo.compute_score,
    "countdown": countdown.compute_score,
    "arithmetic": arithmetic.compute_score,
}

DATA_SOURCE_SCORERS: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "math": "math",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math_dapo": "math_dapo",  # DAPO-Math-17k's rows
    "BytedTsinghua-SIA/DAPO-Math-17k": "math_dapo",
    "countdown": "countdown",
    "arithmetic": "arithmetic",
    "arithmetic_tools": "gsm8k",  # megarl.data.tasks.arithmetic_tools: the last number of the answer counts
}
# Data sources judged by the scorer of their prefix (verl's convention for AIME sets: aime-2024, aime2025, ...).
DATA_SOURCE_PREFIXES: dict[str, str] = {"aime": "math_dapo"}


class UnknownDataSourceError(ConfigError):
    """A sample's data_source has no built-in scorer and no custom reward function is configured."""


def scorer_name_for(data_source: str) -> str:
    """The built-in scorer that judges ``data_source``; UnknownDataSourceError listing the known ones."""
    try:
        return DATA_SOURCE_SCORERS[data_source]
    except KeyError:
        for prefix, name in DATA_SOURCE_PREFIXES.items():
            if str(data_source).lower().startswith(prefix):
                return name
        raise UnknownDataSourceError(
            f"no built-in scorer for data_source {data_source!r}; "
            f"known data sources: {sorted(DATA_SOURCE_SCORERS)}, and those beginning with "
            f"{sorted(DATA_SOURCE_PREFIXES)}. "
            "Configure reward.custom_reward_function.path/name to score other sources."
        ) from None


def check_data_sources(data_sources: Iterable[str]) -> None:
    """Raise UnknownDataSourceError for the first data source without a built-in scorer."""
    for source in dict.fromkeys(data_sources):
        scorer_name_for(source)


# The options whose value is one of a few names (the scorer raises on any other at every call).
OPTION_CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("arithmetic", "mode"): arithmetic.MODES,
    ("gsm8k", "method"): gsm8k.METHODS,
}


def check_scorer_options(options: Mapping[str, Mapping[str, Any]]) -> None:
    """Validate per-scorer options ``{scorer name: {option: value}}`` against the scorers' signatures:
    known names, values of the defaults' types (a number for a float, an integer for an int, true/false
    for a flag; a quoted YAML value is a string and refused), and one of `OPTION_CHOICES` where the
    scorer takes a name."""
    for name, kwargs in options.items():
        if name not in SCORERS:
            raise ConfigError(f"reward_kwargs: {name!r} is not a built-in scorer; known: {sorted(SCORERS)}")
        signature = inspect.signature(SCORERS[name])
        try:
            signature.bind("", None, **dict(kwargs))
        except TypeError as exc:
            raise ConfigError(f"reward_kwargs.{name}: {exc}") from None
        for option, value in kwargs.items():
            default = signature.parameters[option].default
            choices = OPTION_CHOICES.get((name, option))
            if choices is not None and value not in choices:
                raise ConfigError(f"reward_kwargs.{name}.{option} = {value!r}; valid: {list(choices)}")
            if isinstance(default, bool) and not isinstance(value, bool):
                raise ConfigError(f"reward_kwargs.{name}.{option} = {value!r}; valid: true or false")
            if isinstance(default, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"reward_kwargs.{name}.{option} = {value!r}; valid: a number")
            if (isinstance(default, int) and not isinstance(default, bool)
                    and (isinstance(value, bool) or not isinstance(value, int))):
                raise ConfigError(f"reward_kwargs.{name}.{option} = {value!r}; valid: an integer "
                                  f"(default {default})")


def score_builtin(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, float]:
    """Score one sample with the scorer of its data source (``extra_info`` is not used by them)."""
    name = scorer_name_for(data_source)
    return SCORERS[name](solution_str, ground_truth, **dict((options or {}).get(name, {})))
