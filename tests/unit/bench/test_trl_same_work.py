"""The TRL side of the end-to-end benchmark does the work megarl's side does: TRL's own default
recomputes every layer's activations in the backward pass (gradient checkpointing, about a third
more work in an update), megarl's compared runs do not, so the TRL run must switch it off."""

from __future__ import annotations

from pathlib import Path

import pytest
from trl_grpo import grpo_config_kwargs, parse_args

from megarl.config import load_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
ARGS = ["--model-dir", "m", "--tokenizer", "t", "--prompts", "p.json", "--steps", "3", "--work-dir", "w", "--out", "o"]


def test_trl_recomputes_activations_only_when_megarl_does() -> None:
    # The megarl side of the comparison: the quickstart config (benchmarks/megarl_run.py's QUICKSTART).
    megarl_recomputes = load_config(REPO / "configs" / "quickstart_cpu.yaml").model.enable_gradient_checkpointing
    assert megarl_recomputes is False
    assert grpo_config_kwargs(parse_args(ARGS))["gradient_checkpointing"] is False
    assert grpo_config_kwargs(parse_args(ARGS + ["--gradient-checkpointing"]))["gradient_checkpointing"] is True


def test_time_outside_the_steps_is_the_run_minus_its_steps() -> None:
    """Start-up and the end, which the step times and the reward-against-time curves leave out: a
    run of 30 s whose steps took 4 s (first step by its own timer), 2.5 s and 3.5 s (wall clock from
    the previous step's end) spent 20 s outside them."""
    from e2e import outside_steps_s

    records = [{"step_s": 4.0, "wall_s": None}, {"step_s": 2.0, "wall_s": 2.5}, {"step_s": 3.0, "wall_s": 3.5}]
    assert outside_steps_s({"wall_s": 30.0, "records": records}) == 20.0
    assert outside_steps_s({"wall_s": None, "records": records}) is None
