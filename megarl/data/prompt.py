"""Turn a dataset prompt (chat messages or a string) into text and token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from megarl.config.chat_template import require_passable
from megarl.errors import ConfigError

try:  # jinja2 renders chat templates: an optional dependency of transformers, which imports it when present
    from jinja2 import TemplateError

    _TEMPLATE_ERRORS: tuple[type[Exception], ...] = (TemplateError,)
except ImportError:  # pragma: no cover - then no chat template renders at all
    _TEMPLATE_ERRORS = ()

Prompt = str | list[dict[str, str]]


class ChatTemplateError(ValueError):
    """The tokenizer's chat template refused a prompt (its ``raise_exception``, e.g. Gemma's "System
    role not supported"); the message is the template's. The caller names the row."""


def parse_chat_template_mode(value: bool | str | None) -> bool | None:
    """``auto``/None -> None (decide per tokenizer), ``true``/True -> True, ``false``/False -> False."""
    if value is None or isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered == "auto":
        return None
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ConfigError(f"apply_chat_template must be auto, true or false, got {value!r}")


class PromptRenderer:
    """Renders prompts with the tokenizer's chat template, or as plain text.

    With a chat template a message list becomes ``apply_chat_template(..., add_generation_prompt=True)``
    and is encoded without adding special tokens (the template holds them); a string prompt is
    treated as one user message. As plain text the message contents are joined with a blank line and
    encoded with the tokenizer's own special tokens (BOS for Llama-style tokenizers; none for the
    character tokenizer, so "3+4=" is exactly 4 tokens).

    ``apply_chat_template``: None (auto) uses the template when the tokenizer has one.
    Picklable (datasets sends it to worker processes).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        apply_chat_template: bool | str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        mode = parse_chat_template_mode(apply_chat_template)
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if mode is True and not has_template:
            raise ConfigError(
                "apply_chat_template is true but the tokenizer has no chat template "
                f"({getattr(tokenizer, 'name_or_path', '?')}); set it to auto or false"
            )
        self.tokenizer = tokenizer
        self.use_chat_template = has_template if mode is None else mode
        self.chat_template_kwargs = require_passable(chat_template_kwargs)
        self._plain: Tokenizer | None = None  # `plain_backend`, made on first use

    def text(self, prompt: Prompt) -> str:
        """The prompt as the model will see it (before tokenisation); ChatTemplateError when the chat
        template refuses it."""
        if self.use_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            try:
                return self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
                )
            except _TEMPLATE_ERRORS as exc:
                raise ChatTemplateError(str(exc)) from exc
        if isinstance(prompt, str):
            return prompt
        return "\n\n".join(message["content"] for message in prompt)

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of prompts already rendered by :meth:`text` (unpadded, untruncated)."""
        if not texts:
            return []
        return self.tokenizer(list(texts), add_special_tokens=not self.use_chat_template)["input_ids"]

    def plain_backend(self) -> Tokenizer | None:
        """A copy of the fast tokenizer's Rust backend without padding or truncation; None for a slow
        tokenizer. The tokenizer's own backend keeps whatever its tokenizer.json or an earlier call
        with padding / truncation set, which would change every count; :meth:`encode_texts` (the
        tokenizer's __call__ without them) switches both off."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        if self._plain is None:
            self._plain = Tokenizer.from_str(backend.to_str())
            self._plain.no_padding()
            self._plain.no_truncation()
        return self._plain

    def text_lengths(self, texts: Sequence[str]) -> list[int]:
        """Token count of each prompt already rendered by :meth:`text` (:meth:`encode_texts`, counted)."""
        backend = self.plain_backend()
        if backend is None:
            return [len(ids) for ids in self.encode_texts(texts)]
        # A fast tokenizer's ids come from its Rust backend; asking it directly skips building
        # Python lists for every token (several times faster on large datasets).
        return [len(e) for e in backend.encode_batch(list(texts), add_special_tokens=not self.use_chat_template)]

    def fingerprint_parts(self) -> list[str]:
        """What determines the token ids (for dataset cache fingerprints)."""
        tok = self.tokenizer
        backend = self.plain_backend()
        vocab_repr = backend.to_str() if backend is not None else repr(sorted(tok.get_vocab().items()))
        return [
            type(tok).__name__,
            vocab_repr,
            str(getattr(tok, "chat_template", None)),
            str(self.use_chat_template),
            repr(sorted(self.chat_template_kwargs.items())),
        ]
