"""Tokenizers without hub access: build small HF-compatible tokenizers and load local ones.

Two builders write a directory that ``transformers.AutoTokenizer.from_pretrained(dir)`` loads:

- :func:`build_char_tokenizer` — one token per character (a byte-level BPE without merges over a
  given alphabet), for synthetic tasks such as arithmetic where a vocabulary of ~20 is enough.
- :func:`train_bpe_tokenizer` — a byte-level BPE trained on given texts (never an unknown token).

Both save ``tokenizer_class: TokenizersBackend`` (the generic fast tokenizer) so that transformers
loads ``tokenizer.json`` as written; both also encode identically when transformers rebuilds them as
a model family's own byte-level BPE tokenizer (a Qwen2 ``config.json`` next to them does that).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from megarl.errors import ConfigError

logger = logging.getLogger(__name__)

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
# Ids 0..3 in every tokenizer built here, in this order.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

# A ChatML template (the Qwen family's format). Its control tokens must be special tokens of the
# tokenizer (pass CHATML_SPECIAL_TOKENS as ``extra_special_tokens``), else they are spelled out.
CHATML_SPECIAL_TOKENS: tuple[str, ...] = ("<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Contractions, letter runs, single digits, punctuation runs, newlines, other whitespace.
_QWEN2_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Files whose presence marks a directory as a HF tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _wrap_and_save(
    backend: Tokenizer,
    out_dir: str | os.PathLike[str],
    chat_template: str | None,
    extra_special_tokens: Sequence[str],
) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
    )
    if extra_special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(extra_special_tokens)})
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def _byte_level_symbols() -> dict[int, str]:
    """The printable stand-in byte-level BPE uses for each byte (GPT-2's table: a space is 'Ġ')."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def build_char_tokenizer(
    chars: Iterable[str],
    out_dir: str | os.PathLike[str],
    *,
    chat_template: str | None = None,
    extra_special_tokens: Sequence[str] = (),
) -> PreTrainedTokenizerFast:
    """Build a character-level tokenizer, save it to ``out_dir`` and return it.

    Ids: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3, then each distinct character of
    ``chars`` in the order given, then ``extra_special_tokens``. An ASCII character is one token; a
    non-ASCII character is one token per UTF-8 byte. A character outside ``chars`` encodes to
    ``<unk>``. Encoding adds no BOS/EOS: a prompt is exactly its characters.

    It is a byte-level BPE with no merges rather than a WordLevel model: transformers rebuilds the
    tokenizer of some model families (Qwen2 among them) from vocab and merges as byte-level BPE
    when a model ``config.json`` sits in the same directory, and only this form survives that.
    """
    alphabet = list(dict.fromkeys(chars))
    for ch in alphabet:
        if len(ch) != 1:
            raise ConfigError(f"build_char_tokenizer: {ch!r} is not a single character")
    if not alphabet:
        raise ConfigError("build_char_tokenizer: the character set is empty")
    symbols = _byte_level_symbols()
    byte_tokens = dict.fromkeys(symbols[b] for ch in alphabet for b in ch.encode("utf-8"))
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *byte_tokens])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return _wrap_and_save(backend, out_dir, chat_template, extra_special_tokens)


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | os.PathLike[str],
    *,
    min_frequency: int = 1,
    chat_template: str | None = None,
    extra_special_tokens: Sequence[str] = (),
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts``, save it to ``out_dir`` and return it.

    ``vocab_size`` counts the 256 byte tokens, the merges and the special tokens; it must be at
    least ``256 + len(SPECIAL_TOKENS) + len(extra_special_tokens)``. Any text encodes (bytes).
    """
    specials = [*SPECIAL_TOKENS, *extra_special_tokens]
    minimum = 256 + len(specials)
    if vocab_size < minimum:
        raise ConfigError(
            f"train_bpe_tokenizer: vocab_size={vocab_size} is below the minimum {minimum} "
            "(256 bytes + special tokens)"
        )
    backend = Tokenizer(models.BPE(unk_token=None))
    # The Qwen2 family's normalisation and pre-tokenisation (digits split one by one), so that the
    # tokenizer encodes the same when transformers rebuilds it as a Qwen2 tokenizer.
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    # Extra special tokens were trained in; the wrapper only has to mark them special again.
    return _wrap_and_save(backend, out_dir, chat_template, extra_special_tokens)


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load a HF tokenizer from a local directory (no hub access).

    If the tokenizer has no pad token, its EOS token is used for padding (as most decoder-only
    models do). Raises :class:`ConfigError` naming the path when it is missing or not a tokenizer.
    """
    directory = Path(path)
    if not directory.exists():
        raise ConfigError(f"tokenizer directory '{directory}' does not exist")
    if not directory.is_dir():
        raise ConfigError(
            f"tokenizer path '{directory}' is not a directory (expected a HF tokenizer directory)"
        )
    if not any((directory / name).exists() for name in _TOKENIZER_FILES):
        present = sorted(p.name for p in directory.iterdir())[:20]
        raise ConfigError(
            f"'{directory}' is not a tokenizer directory: none of {list(_TOKENIZER_FILES)} found "
            f"(present: {present})"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises many types here; name the directory once
        raise ConfigError(
            f"could not load a tokenizer from '{directory}': {type(exc).__name__}: {exc}"
        ) from exc
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ConfigError(
                f"tokenizer in '{directory}' has neither a pad nor an eos token; padding is impossible"
            )
        logger.warning(
            "tokenizer in '%s' has no pad token; using eos '%s' for padding", directory, tokenizer.eos_token
        )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
