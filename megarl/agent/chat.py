"""Token ids of the tool-role turns a multi-turn rollout appends, and the retokenisation check.

The tool outputs of one assistant turn become one stretch of tokens: the chat template's rendering
of the tool messages (and the opening of the next assistant turn), taken as the difference between
two renderings of a fixed conversation, so whatever the template writes between an assistant turn's
end and the next assistant turn is there exactly once. These ids are tokenised once and appended;
the model's own ids are never re-tokenised (token-in, token-out).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megarl.errors import ConfigError

# A stand-in conversation: the template renders it once without and once with the tool messages.
_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class ToolTurnEncoder:
    """Renders tool results as the tool-role turn of `tokenizer`'s chat template and tokenises it.

    `encode(texts)` -> ids of: [end of the assistant turn after its EOS] + one tool message per text
    + the next assistant turn's opening (the template's generation prompt).
    """

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "rollout.multi_turn: the tokenizer has no chat_template; multi-turn rollouts render tool outputs "
                "as the template's tool-role turn (save a tokenizer with a chat template next to the model)")
        self.tokenizer = tokenizer
        base = self._render(_BASE, generation_prompt=False)
        end = base.rfind(_BASE[-1]["content"]) + len(_BASE[-1]["content"])
        self._prefix = base[:end]
        # The special token the template closes an assistant turn with (ChatML's <|im_end|>), if any: a
        # model turn that ended on it already holds it, and the tool turn's text then starts after it.
        specials = sorted(getattr(tokenizer, "all_special_tokens", []) or [], key=len, reverse=True)
        self.end_of_turn = next((tok for tok in specials if tok and base.startswith(tok, end)), None)
        self.text(["0"])  # a template that renders earlier turns otherwise is refused here, not at a tool call

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def text(self, outputs: Sequence[str], ended_on: int | None = None) -> str:
        """The text appended after an assistant turn, for these tool outputs. `ended_on`: the id of the
        turn's last token (None: the tokenizer's EOS); when it is the template's end-of-turn token, the
        text starts after it (the model wrote it), else with it (the turn is closed as the template
        closes it)."""
        full = self._render(_BASE + [{"role": "tool", "content": t} for t in outputs], generation_prompt=True)
        if not full.startswith(self._prefix):
            raise ConfigError(
                "rollout.multi_turn: the chat template renders an earlier turn differently once tool messages follow "
                f"(expected the rendering to start with {self._prefix!r}); it cannot be used for multi-turn rollouts")
        tail = full[len(self._prefix):]
        last = self.tokenizer.eos_token if ended_on is None else self.tokenizer.convert_ids_to_tokens(int(ended_on))
        if self.end_of_turn is not None and last == self.end_of_turn and tail.startswith(self.end_of_turn):
            tail = tail[len(self.end_of_turn):]
        return tail

    def encode(self, outputs: Sequence[str], ended_on: int | None = None) -> list[int]:
        """Ids of `text(outputs, ended_on)`. The template's own text is tokenised with its special
        tokens; each tool output is tokenised on its own with special-token parsing off, so an output
        that prints `<|im_end|>` or `<|im_start|>assistant` reaches the model as plain text and cannot
        close its turn or open another. A template that does not copy an output verbatim (one
        placeholder per output, in order) has its whole text tokenised as one string, as before."""
        marks = [f"MEGARLTOOLOUTPUT{i}X" for i in range(len(outputs))]
        rendered = self.text(marks, ended_on)
        if any(rendered.count(mark) != 1 for mark in marks) or any(mark in "".join(outputs) for mark in marks):
            return list(self.tokenizer.encode(self.text(outputs, ended_on), add_special_tokens=False))
        ids: list[int] = []
        for mark, output in zip(marks, outputs):
            before, rendered = rendered.split(mark, 1)
            ids += self.tokenizer.encode(before, add_special_tokens=False)
            ids += self.tokenizer.encode(output, add_special_tokens=False, split_special_tokens=True)
        return ids + list(self.tokenizer.encode(rendered, add_special_tokens=False))


def retokenize_mismatch(tokenizer: Any, ids: Sequence[int]) -> bool:
    """Whether decoding `ids` and encoding the text again gives other ids (a trainer that re-tokenised
    the conversation would then train on tokens the model never produced)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    return list(tokenizer.encode(text, add_special_tokens=False)) != list(ids)
