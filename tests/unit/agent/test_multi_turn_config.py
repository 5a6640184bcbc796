"""`rollout.multi_turn.*`: validation, resolution into the agent loop's settings, tools by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megarl.agent.loop import AgentSettings
from megarl.agent.parsers import _PARSERS
from megarl.agent.tools import BUILTIN_TOOLS, CalculatorTool, PythonTool, ToolSet
from megarl.config import load_config
from megarl.config.rollout_rules import MULTI_TURN_FORMATS, MULTI_TURN_TOOLS
from megarl.errors import ConfigError
from megarl.trainer.run_spec import multi_turn_settings

pytestmark = pytest.mark.unit

BASE = {
    "data": {"train_files": ["train.parquet"], "train_batch_size": 8, "max_prompt_length": 32, "max_response_length": 48},
    "model": {"hf_config": {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 64,
                            "max_position_embeddings": 128}},
    "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2},
    "rollout": {"n": 4, "multi_turn": {"enable": True, "tools": ["calculator"]}},
    "resources": {"actor_pool": {"nnodes": 1, "devices_per_node": 1}},
}


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(BASE))
    return path


def errors_of(path: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


def test_settings_resolve_from_every_key(config_file: Path) -> None:
    cfg = load_config(config_file, ["rollout.multi_turn.max_turns=5", "rollout.multi_turn.tool_timeout_s=2.5",
                                    "rollout.multi_turn.max_parallel_calls=3",
                                    "rollout.multi_turn.max_tool_response_chars=100",
                                    "rollout.multi_turn.wait_for_tools=false",
                                    "rollout.multi_turn.tool_response_truncate_side=right",
                                    "rollout.multi_turn.tools=[calculator,code_interpreter]"])
    settings = multi_turn_settings(cfg.rollout.multi_turn, 48)
    assert settings == AgentSettings(max_turns=5, max_response_length=48, tool_timeout_s=2.5, max_parallel_calls=3,
                                     max_tool_response_chars=100, tool_response_truncate_side="right", format="hermes",
                                     tools=("calculator", "code_interpreter"), wait_for_tools=False)
    off = load_config(config_file, ["rollout.multi_turn.enable=false", "rollout.multi_turn.tools=[]"])
    assert multi_turn_settings(off.rollout.multi_turn, 48) is None


def test_the_tool_turn_takes_the_prompts_chat_template_kwargs(config_file: Path) -> None:
    # data.apply_chat_template_kwargs (e.g. Qwen3's enable_thinking: false) shaped the prompt; the
    # rollout's tool turns, rendered by the workers' agent loop, must be rendered with them too.
    from megarl.trainer.run_spec import resolve_run_spec

    cfg = load_config(config_file, ["data.apply_chat_template_kwargs={enable_thinking: false}"])
    assert multi_turn_settings(cfg.rollout.multi_turn, 48, cfg.data.apply_chat_template_kwargs).chat_template_kwargs \
        == {"enable_thinking": False}
    spec = resolve_run_spec(cfg, "model", pad_token_id=0, eos_token_ids=[1], total_steps=1)
    assert spec.rollout.multi_turn.chat_template_kwargs == {"enable_thinking": False}
    assert multi_turn_settings(cfg.rollout.multi_turn, 48).chat_template_kwargs is None


def test_bad_values_are_named(config_file: Path) -> None:
    assert "rollout.multi_turn.max_turns = 0: must be > 0" in errors_of(config_file, "rollout.multi_turn.max_turns=0")
    assert "rollout.multi_turn.tool_timeout_s = -1" in errors_of(config_file, "rollout.multi_turn.tool_timeout_s=-1")
    assert "rollout.multi_turn.max_parallel_calls = 0" in errors_of(config_file, "rollout.multi_turn.max_parallel_calls=0")
    assert "rollout.multi_turn.max_tool_response_chars = 0" in errors_of(
        config_file, "rollout.multi_turn.max_tool_response_chars=0")
    assert "rollout.multi_turn.tools is empty" in errors_of(config_file, "rollout.multi_turn.tools=[]")
    msg = errors_of(config_file, "rollout.multi_turn.tools=[search]")
    assert "unknown tool 'search'" in msg and "calculator" in msg
    assert "rollout.multi_turn.format = 'json'" in errors_of(config_file, "rollout.multi_turn.format=json")
    msg = errors_of(config_file, "rollout.multi_turn.tool_response_truncate_side=start")
    assert "rollout.multi_turn.tool_response_truncate_side = 'start'" in msg and "'middle'" in msg
    assert "rollout.ignore_eos = true with rollout.multi_turn.enable" in errors_of(config_file, "rollout.ignore_eos=true")


def test_validation_lists_match_the_registries() -> None:
    assert MULTI_TURN_TOOLS == set(BUILTIN_TOOLS)
    assert MULTI_TURN_FORMATS == set(_PARSERS)


def test_tools_by_name_and_by_import_path() -> None:
    tools = ToolSet.from_names(["calculator", "megarl.agent.tools:PythonTool"], timeout_s=3.0)
    assert isinstance(tools.tools["calculator"], CalculatorTool) and isinstance(tools.tools["code_interpreter"], PythonTool)
    assert tools.tools["calculator"].timeout_s == 3.0
    with pytest.raises(ValueError, match="not a subclass of megarl.agent.tools.Tool"):
        ToolSet.from_names(["megarl.agent.tools:ToolResult"])
    with pytest.raises(ValueError, match="cannot import"):
        ToolSet.from_names(["megarl.no_such_module:Tool"])
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        ToolSet.from_names(["calculator", "megarl.agent.tools:CalculatorTool"])
