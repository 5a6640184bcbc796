"""Building one dataset row in verl's column layout."""

from __future__ import annotations

from typing import Any


def verl_row(
    *, data_source: str, content: str, ground_truth: Any, ability: str, split: str, index: int, **extra: Any
) -> dict[str, Any]:
    """A row whose prompt is one user message; ``extra`` goes into ``extra_info`` next to split and index."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, **extra},
    }
