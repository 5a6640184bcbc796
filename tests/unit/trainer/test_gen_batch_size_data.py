"""`data.gen_batch_size` (DAPO's prompts per generation round) larger than the training data is
refused when the datasets are built, naming the key and the files, as `data.train_batch_size` is
(before, the sampler refused it without naming either: "a dataset of 10 rows gives no batch of 12
with drop_last")."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.data.parquet_io import write_parquet
from megarl.data.tokenizer import build_char_tokenizer
from megarl.errors import ConfigError
from megarl.trainer.setup import build_datasets

pytestmark = pytest.mark.unit


def test_a_generation_round_larger_than_the_data_is_refused_by_name(tmp_path: Path) -> None:
    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": f"{i % 10}+1="}],
             "reward_model": {"style": "rule", "ground_truth": str(i % 10 + 1)}} for i in range(10)]
    train = tmp_path / "train.parquet"
    write_parquet(rows, train)
    tokenizer = build_char_tokenizer("0123456789+=", tmp_path / "tok")
    (tmp_path / "exp.yaml").write_text(
        f"data: {{train_files: [{train}], tokenizer: {tmp_path / 'tok'}, train_batch_size: 4,\n"
        "       max_prompt_length: 16, max_response_length: 4, apply_chat_template: 'false'}\n"
        "model: {hf_config: {model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,\n"
        "        num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 32, max_position_embeddings: 64}}\n"
        "actor: {ppo_mini_batch_size: 4, ppo_micro_batch_size_per_gpu: 2}\nrollout: {n: 2}\n"
        "algorithm: {filter_groups: {enable: true, metric: acc}}\n")

    def build(gen_batch_size: int) -> int:
        loader, _ = build_datasets(load_config(tmp_path / "exp.yaml", [f"data.gen_batch_size={gen_batch_size}"]),
                                   tokenizer)
        return loader.sampler.batch_size

    assert build(10) == 10  # one round may take every prompt
    with pytest.raises(ConfigError) as refused:
        build(12)
    message = str(refused.value)
    assert "data.gen_batch_size = 12" in message and "hold 10 usable prompts" in message, message
    assert f"data.train_files ({train})" in message and "at most 10" in message, message
