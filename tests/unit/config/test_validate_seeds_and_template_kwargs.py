"""Validation of values that used to pass `megarl config validate` and fail later: seeds the random
generators refuse (data.seed at the first batch, trainer.seed in vLLM's engines), and
data.apply_chat_template_kwargs that clash with the arguments megarl passes or that nothing reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.config.rollout_rules import ROLLOUT_SEED_FACTOR
from megarl.trainer.run_spec import resolve_run_spec
from test_config import errors_of, valid_file  # noqa: F401 (valid_file: the fixture)

pytestmark = pytest.mark.unit

# VALID's actor pool has 2 devices: vLLM engine r (< 2) is seeded trainer.seed x 1000 + r <= 2**32 - 1.
HIGHEST_TRAINER_SEED = (2**32 - 2) // 1000


def test_a_negative_data_seed_is_refused(valid_file: Path) -> None:
    msg = errors_of(valid_file, "data.seed=-1")
    assert "data.seed = -1: must be an integer >= 0" in msg
    assert load_config(valid_file, ["data.seed=0"]).data.seed == 0
    assert load_config(valid_file, ["data.seed=12345678901"]).data.seed == 12345678901  # numpy takes any size


@pytest.mark.parametrize("engine", ["auto", "vllm"])
def test_trainer_seed_must_fit_the_vllm_engines_seed(valid_file: Path, engine: str) -> None:
    for seed in (-1, HIGHEST_TRAINER_SEED + 1):
        msg = errors_of(valid_file, f"trainer.seed={seed}", f"rollout.engine={engine}")
        assert (f"trainer.seed = {seed} with rollout.engine = '{engine}': must be in [0, {HIGHEST_TRAINER_SEED}]"
                in msg)
        assert "or rollout.engine: hf" in msg
    for seed in (0, HIGHEST_TRAINER_SEED):
        assert load_config(valid_file, [f"trainer.seed={seed}", f"rollout.engine={engine}"]).trainer.seed == seed


def test_the_hf_engine_and_torch_take_any_trainer_seed(valid_file: Path) -> None:
    # torch.manual_seed and torch.Generator().manual_seed accept negative seeds (mapped to 2**64 + seed).
    assert load_config(valid_file, ["trainer.seed=-1", "rollout.engine=hf"]).trainer.seed == -1


def test_the_rule_knows_how_run_spec_seeds_the_rollout_engines(valid_file: Path) -> None:
    cfg = load_config(valid_file, ["trainer.seed=7"])
    spec = resolve_run_spec(cfg, "model", pad_token_id=0, eos_token_ids=[1], total_steps=1)
    assert spec.rollout.options.seed == 7 * ROLLOUT_SEED_FACTOR


@pytest.mark.parametrize("key", ["add_generation_prompt", "tokenize", "messages", "conversation",
                                 "continue_final_message"])
def test_chat_template_kwargs_that_megarl_passes_itself_are_refused(valid_file: Path, key: str) -> None:
    msg = errors_of(valid_file, f"data.apply_chat_template_kwargs.{key}=false")
    assert f"data.apply_chat_template_kwargs sets ['{key}']: megarl passes these to the chat template itself" in msg


def test_chat_template_kwargs_for_the_templates_tokenisation_are_refused(valid_file: Path) -> None:
    msg = errors_of(valid_file,
                    "data.apply_chat_template_kwargs={padding: true, max_length: 8, enable_thinking: false}")
    assert "data.apply_chat_template_kwargs sets ['padding', 'max_length']: these act only when the template" in msg


def test_chat_template_kwargs_need_a_chat_template_that_reads_them(valid_file: Path) -> None:
    kwargs = "data.apply_chat_template_kwargs={enable_thinking: false}"
    msg = errors_of(valid_file, kwargs, "data.apply_chat_template=false")
    assert ("data.apply_chat_template_kwargs = {'enable_thinking': False} with data.apply_chat_template = 'False' "
            "and no multi-turn rollout: no chat template is applied, nothing reads them; set "
            "data.apply_chat_template auto or true (or rollout.multi_turn.enable), or remove them") in msg
    for mode in ("auto", "true"):  # the prompts are rendered with them
        cfg = load_config(valid_file, [kwargs, f"data.apply_chat_template={mode}"])
        assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    # Multi-turn rollouts render the tool turns with the template whatever data.apply_chat_template says.
    multi_turn = ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"]
    assert load_config(valid_file, [kwargs, "data.apply_chat_template=false", *multi_turn]).rollout.multi_turn.enable
    # Without the kwargs the mode is any of its values (the override's YAML bool is stored as "False").
    assert load_config(valid_file, ["data.apply_chat_template=false"]).data.apply_chat_template == "False"
