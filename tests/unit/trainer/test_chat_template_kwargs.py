"""`data.apply_chat_template_kwargs` (verl's key) reaches the tokenizer's chat template when the datasets
are built, e.g. Qwen3's `enable_thinking: false`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.data.parquet_io import write_parquet
from megarl.data.tokenizer import build_char_tokenizer
from megarl.trainer.setup import build_datasets

pytestmark = pytest.mark.unit

# Renders "N" before the prompt when the template is told enable_thinking=false, else "T".
TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}N{% else %}T{% endif %}"
            "{{ messages[0]['content'] }}")


def test_chat_template_kwargs_reach_the_template(tmp_path: Path) -> None:
    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": f"{i}+1="}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(4)]
    write_parquet(rows, tmp_path / "train.parquet")
    tokenizer = build_char_tokenizer("0123456789+=NT", tmp_path / "tok", chat_template=TEMPLATE)
    (tmp_path / "exp.yaml").write_text(
        f"data: {{train_files: [{tmp_path / 'train.parquet'}], tokenizer: {tmp_path / 'tok'}, train_batch_size: 4,\n"
        "       max_prompt_length: 16, max_response_length: 4, apply_chat_template: 'true', shuffle: false}\n"
        "model: {hf_config: {model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,\n"
        "        num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 32, max_position_embeddings: 64}}\n"
        "actor: {ppo_mini_batch_size: 4, ppo_micro_batch_size_per_gpu: 2}\nrollout: {n: 2}\n")

    def first_prompt(*overrides: str) -> str:
        loader, _ = build_datasets(load_config(tmp_path / "exp.yaml", list(overrides)), tokenizer)
        row = loader.dataset.get_rows([0])
        batch = loader.dataset.collate(row, uids=["u0"])
        return tokenizer.decode(batch["input_ids"][0][batch["attention_mask"][0].bool()])

    assert first_prompt() == "T0+1="
    assert first_prompt("data.apply_chat_template_kwargs={enable_thinking: false}") == "N0+1="


@pytest.mark.parametrize("kwargs, named", [({"tokenize": True}, "['tokenize']"),
                                           ({"add_generation_prompt": False, "max_length": 9}, "['max_length']")])
def test_a_renderer_built_without_a_config_refuses_what_it_cannot_pass_on(tmp_path: Path, kwargs: dict,
                                                                          named: str) -> None:
    """An RLDataset or tool-turn encoder built directly (no validated config) names the argument
    instead of failing inside transformers (`tokenize` twice: a TypeError at the first prompt)."""
    from megarl.agent.chat import ToolTurnEncoder
    from megarl.data.dataset import RLDataset
    from megarl.errors import ConfigError

    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": "1+1="}],
             "reward_model": {"style": "rule", "ground_truth": "2"}}]
    write_parquet(rows, tmp_path / "train.parquet")
    tokenizer = build_char_tokenizer("0123456789+=NT", tmp_path / "tok", chat_template=TEMPLATE)
    with pytest.raises(ConfigError, match=rf"chat_template_kwargs sets {re.escape(named)}"):
        RLDataset([str(tmp_path / "train.parquet")], tokenizer, max_prompt_length=16, chat_template_kwargs=kwargs)
    with pytest.raises(ConfigError, match=rf"chat_template_kwargs sets {re.escape(named)}"):
        ToolTurnEncoder(tokenizer, kwargs)
