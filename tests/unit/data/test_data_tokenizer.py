"""Tokenizers built offline round trip through transformers.AutoTokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from data_helpers import DIGITS_AND_OPS
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from megarl.data.tokenizer import (
    CHATML_SPECIAL_TOKENS,
    CHATML_TEMPLATE,
    build_char_tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)
from megarl.errors import ConfigError

pytestmark = pytest.mark.unit

# Ids by construction: <pad> 0, <bos> 1, <eos> 2, <unk> 3, then the characters in the order given.
CHAR_ID = {ch: 4 + i for i, ch in enumerate(DIGITS_AND_OPS)}


def tiny_config(family: str) -> transformers.PretrainedConfig:
    cls = {
        "qwen2": transformers.Qwen2Config,
        "llama": transformers.LlamaConfig,
        "qwen3": transformers.Qwen3Config,
    }[family]
    return cls(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
    )


def test_char_tokenizer_ids_and_round_trip_through_auto_tokenizer(char_tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(char_tokenizer_dir))
    assert (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.unk_token_id,
    ) == (0, 1, 2, 3)
    assert len(tokenizer) == 4 + len(DIGITS_AND_OPS)
    for text in ["3+4=", "12 * 34 - 5 = 403", "0", "= =  99"]:
        ids = tokenizer(text)["input_ids"]
        assert ids == [CHAR_ID[ch] for ch in text]  # one token per character, no BOS/EOS added
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(ids + [tokenizer.eos_token_id, 0, 0], skip_special_tokens=True) == text


def test_char_tokenizer_unknown_character_is_unk(char_tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(char_tokenizer_dir))
    assert tokenizer("3x4")["input_ids"] == [CHAR_ID["3"], 3, CHAR_ID["4"]]


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_char_tokenizer_survives_a_model_config_in_the_same_directory(tmp_path: Path, family: str) -> None:
    # transformers rebuilds the tokenizer of some families (Qwen2) from vocab + merges when a
    # config.json sits next to it; a WordLevel tokenizer would encode to nothing then.
    build_char_tokenizer(DIGITS_AND_OPS, tmp_path)
    tiny_config(family).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "12 * 34 - 5 = 403"
    ids = tokenizer(text)["input_ids"]
    assert ids == [CHAR_ID[ch] for ch in text]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0


def test_char_tokenizer_with_chat_template(tmp_path: Path) -> None:
    build_char_tokenizer(
        "0123456789+=abcdefghijklmnopqrstuvwxyz\n",
        tmp_path,
        chat_template=CHATML_TEMPLATE,
        extra_special_tokens=CHATML_SPECIAL_TOKENS,
    )
    tokenizer = load_tokenizer(tmp_path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "3+4="}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 2 and im_start > 3
    assert tokenizer.decode(ids) == text
    assert len(ids) == len(text) - 2 * (len("<|im_start|>") - 1) - (len("<|im_end|>") - 1)


def test_char_tokenizer_rejects_bad_alphabets(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a single character"):
        build_char_tokenizer(["ab", "c"], tmp_path)
    with pytest.raises(ConfigError, match="empty"):
        build_char_tokenizer("", tmp_path)


def test_bpe_tokenizer_learns_merges_and_round_trips_any_text(tmp_path: Path) -> None:
    corpus = ["the answer is 42"] * 50 + ["hello world"] * 50
    built = train_bpe_tokenizer(corpus, 300, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tokenizer) == len(built) <= 300
    # Frequent text is merged into fewer tokens than it has bytes.
    assert len(tokenizer("the answer is 42")["input_ids"]) < len("the answer is 42")
    for text in ["the answer is 42", "unseen: Zürich ✓ \t\n", ""]:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == "<eos>" and tokenizer.pad_token_id == 0


def test_bpe_tokenizer_survives_a_qwen2_config(tmp_path: Path) -> None:
    train_bpe_tokenizer(["the answer is 42"] * 20, 280, tmp_path)
    direct = AutoTokenizer.from_pretrained(str(tmp_path))
    tiny_config("qwen2").save_pretrained(tmp_path)
    rebuilt = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "the answer is 42, not 24"
    assert rebuilt(text)["input_ids"] == direct(text)["input_ids"]
    assert rebuilt.decode(rebuilt(text)["input_ids"]) == text


def test_bpe_vocab_size_below_the_byte_alphabet_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="minimum 260"):
        train_bpe_tokenizer(["abc"], 100, tmp_path)


def test_load_tokenizer_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as missing:
        load_tokenizer(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(missing.value)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        load_tokenizer(tmp_path / "file.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "weights.bin").write_text("x")
    with pytest.raises(ConfigError, match="not a tokenizer directory.*weights.bin"):
        load_tokenizer(empty)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    (broken / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(ConfigError, match="could not load a tokenizer from") as bad:
        load_tokenizer(broken)
    assert str(broken) in str(bad.value)


def test_load_tokenizer_pads_with_eos_when_there_is_no_pad_token(tmp_path: Path) -> None:
    backend = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "</s>": 1, "a": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>").save_pretrained(
        tmp_path
    )
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 1
