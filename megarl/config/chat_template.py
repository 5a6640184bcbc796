"""`data.apply_chat_template_kwargs`: which extra arguments of a tokenizer's `apply_chat_template`
megarl can pass on. Torch-free, so that config validation and the prompt renderer share one rule."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megarl.errors import ConfigError

# Arguments megarl sets itself (the prompt's messages, the generation prompt, text out), or that act
# only on the template's own tokenisation, which megarl does after rendering.
OWN_ARGS = ("conversation", "messages", "add_generation_prompt", "continue_final_message", "tokenize")
TOKENIZE_ARGS = ("padding", "truncation", "max_length", "return_tensors", "return_dict",
                 "return_assistant_tokens_mask", "tokenizer_kwargs")


def chat_template_kwargs_errors(kwargs: Mapping[str, Any], key: str = "data.apply_chat_template_kwargs") -> list[str]:
    """A message for each kind of argument in `kwargs` that megarl cannot pass to the chat template."""
    errors = []
    own = [name for name in kwargs if name in OWN_ARGS]
    if own:
        errors.append(f"{key} sets {own}: megarl passes these to the chat template itself (the messages, "
                      "add_generation_prompt: true, tokenize: false); remove them (the keys are the template's own "
                      "variables, e.g. enable_thinking)")
    tokenizing = [name for name in kwargs if name in TOKENIZE_ARGS]
    if tokenizing:
        errors.append(f"{key} sets {tokenizing}: these act only when the template tokenises, and megarl renders "
                      "text and tokenises it itself (prompt length: data.max_prompt_length, data.truncation); "
                      "remove them")
    return errors


def require_passable(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """`kwargs` as a dict, or a ConfigError naming what megarl cannot pass to the chat template (for
    a renderer built without a validated config)."""
    errors = chat_template_kwargs_errors(kwargs or {}, key="chat_template_kwargs")
    if errors:
        raise ConfigError("; ".join(errors))
    return dict(kwargs or {})
