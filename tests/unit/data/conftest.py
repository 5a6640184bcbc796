from __future__ import annotations

from pathlib import Path

import pytest
from data_helpers import DIGITS_AND_OPS
from transformers import PreTrainedTokenizerBase

from megarl.data.tokenizer import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, build_char_tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def char_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("char_tokenizer")
    build_char_tokenizer(DIGITS_AND_OPS, out)
    return out


@pytest.fixture(scope="session")
def char_tokenizer(char_tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(char_tokenizer_dir)


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    out = tmp_path_factory.mktemp("chat_tokenizer")
    chars = DIGITS_AND_OPS + "abcdefghijklmnopqrstuvwxyz\n"
    build_char_tokenizer(
        chars, out, chat_template=CHATML_TEMPLATE, extra_special_tokens=CHATML_SPECIAL_TOKENS
    )
    return load_tokenizer(out)


@pytest.fixture
def cache_dir(tmp_path: Path) -> str:
    return str(tmp_path / "datasets_cache")
