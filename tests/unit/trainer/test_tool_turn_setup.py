"""The driver's check of the chat template's tool turn (`prepare_run`, before workers start) renders it
with the template arguments the prompts get (`data.apply_chat_template_kwargs`, e.g. Qwen3's
`enable_thinking: false`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megarl.config import load_config
from megarl.data.parquet_io import write_parquet
from megarl.data.tokenizer import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, build_char_tokenizer
from megarl.trainer import setup

pytestmark = pytest.mark.unit


class Checked(Exception):
    """Stops prepare_run once the tool turn was checked."""


def _write_run(tmp_path: Path, rows: list[dict[str, Any]]) -> None:
    """`rows` as the training data, a ChatML character tokenizer and a run's `exp.yaml` under `tmp_path`."""
    write_parquet(rows, tmp_path / "train.parquet")
    build_char_tokenizer("0123456789+=\nabcdefghijklmnopqrstuvwxyz_<>|", tmp_path / "tok", chat_template=CHATML_TEMPLATE,
                         extra_special_tokens=CHATML_SPECIAL_TOKENS)
    (tmp_path / "exp.yaml").write_text(
        f"data: {{train_files: [{tmp_path / 'train.parquet'}], tokenizer: {tmp_path / 'tok'}, train_batch_size: 4,\n"
        "       max_prompt_length: 32, max_response_length: 8, shuffle: false}\n"
        "model: {hf_config: {model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,\n"
        "        num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 64, max_position_embeddings: 64}}\n"
        f"actor: {{ppo_mini_batch_size: 4, ppo_micro_batch_size_per_gpu: 2}}\nrollout: {{n: 2}}\n"
        f"trainer: {{default_local_dir: {tmp_path / 'run'}}}\n")


def test_the_tool_turn_check_gets_the_chat_template_kwargs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": f"{i}+1="}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(4)]
    _write_run(tmp_path, rows)
    seen: list[Any] = []

    def encoder(tokenizer: Any, chat_template_kwargs: Any = None) -> None:
        seen.append(chat_template_kwargs)
        raise Checked

    monkeypatch.setattr(setup, "ToolTurnEncoder", encoder)
    cfg = load_config(tmp_path / "exp.yaml", ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]",
                                              "data.apply_chat_template_kwargs={enable_thinking: false}"])
    with pytest.raises(Checked):
        setup.prepare_run(cfg)
    assert seen == [{"enable_thinking": False}]


def test_the_training_data_is_checked_against_the_runs_tools_when_opened(tmp_path: Path) -> None:
    """`build_datasets` hands the run's tools (by the names the tools give themselves) to the dataset,
    so a row whose extra_info.tools_kwargs names a tool the run lacks is refused by file and row
    before any worker starts."""
    from megarl.data.tokenizer import load_tokenizer
    from megarl.errors import DataError

    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": f"{i}+1="}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"tools_kwargs": {"search" if i == 2 else "calculator": {"create_kwargs": {"x": "1"}}}}}
            for i in range(4)]
    _write_run(tmp_path, rows)
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    with_tools = load_config(tmp_path / "exp.yaml", ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"])
    with pytest.raises(DataError, match=r"train\.parquet.*row 2.*extra_info.*search.*calculator"):
        setup.build_datasets(with_tools, tokenizer)
    loader, _ = setup.build_datasets(load_config(tmp_path / "exp.yaml"), tokenizer)  # without tools it is not read
    assert len(loader.dataset) == 4
