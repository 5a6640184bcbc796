"""Token ids of the tool-role turns a multi-turn rollout appends, and the retokenisation check.

The tool outputs of one assistant turn become one stretch of tokens: the chat template's rendering
of the tool messages (and the opening of the next assistant turn), taken from a rendering of a
stand-in conversation as everything the template writes after the assistant turn's content, so
whatever the template writes between an assistant turn's end and the next assistant turn is there
exactly once. Only the text after the assistant turn is taken: a template may render the turn's
opening otherwise once tool messages follow (Qwen3 prints an empty think block in the last
assistant message only), which changes nothing the model has not already produced. These ids are
tokenised once and appended; the model's own ids are never re-tokenised (token-in, token-out).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from megarl.config.chat_template import require_passable
from megarl.errors import ConfigError

# Stand-in contents: the user's prompt, the model's turns, and a tool output of an earlier round.
_USER, _MODEL, _MODEL_LATER, _EARLIER = "MEGARLUSERTURN", "MEGARLMODELTURN", "MEGARLMODELLATERTURN", "MEGARLEARLIER"
# A tool output with the characters templates escape or trim (JSON strings, HTML, `| trim`): a
# template that shows it as it is shows every output as it is.
_PROBE = ' a"b\\c\n<&>\'\t/ '
# Plain texts put before a piece of text so that it is tokenised as text in the middle of a
# conversation, not as the start of one (SentencePiece's leading "▁").
_CONTEXTS = ("\n", " ", "0", "a", ".")


def _tool_messages(outputs: Sequence[str]) -> list[dict[str, str]]:
    return [{"role": "tool", "content": t} for t in outputs]


class ToolTurnEncoder:
    """Renders tool results as the tool-role turn of `tokenizer`'s chat template and tokenises it.

    `encode(texts)` -> ids of: [end of the assistant turn after its EOS] + one tool message per text
    + the next assistant turn's opening (the template's generation prompt). `chat_template_kwargs`:
    the template's extra arguments, the ones the prompts were rendered with
    (`data.apply_chat_template_kwargs`, e.g. Qwen3's `enable_thinking`), so that the next assistant
    turn opens as the first one did.
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "rollout.multi_turn: the tokenizer has no chat_template; multi-turn rollouts render tool outputs "
                "as the template's tool-role turn (save a tokenizer with a chat template next to the model)")
        self.tokenizer = tokenizer
        self.chat_template_kwargs = require_passable(chat_template_kwargs)
        one, two = self._tail(["MEGARLTOOLOUTPUT0X"]), self._tail(["MEGARLTOOLOUTPUT0X", "MEGARLTOOLOUTPUT1X"])
        # The special token the template closes an assistant turn with (ChatML's <|im_end|>), if any: a
        # model turn that ended on it already holds it, and the tool turn's text then starts after it.
        specials = sorted(getattr(tokenizer, "all_special_tokens", []) or [], key=len, reverse=True)
        self.end_of_turn = next((tok for tok in specials if tok and one.startswith(tok)), None)
        self._check_tool_turn(one, two)
        # Ids of the tokenizer's added tokens (special or not): what a tool output must not turn into.
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = set(decoder) | set(getattr(tokenizer, "all_special_ids", []) or [])
        self._anchor = self._special_id(getattr(tokenizer, "eos_token_id", None))
        if self._anchor is None and self.end_of_turn is not None:
            self._anchor = tokenizer.convert_tokens_to_ids(self.end_of_turn)
        self._learn_boundaries()
        self._verbatim = self._shown(_PROBE) == _PROBE
        self._template_tokens: dict[tuple[int, bool], Counter] = {}

    # -- the template's text ------------------------------------------------------------------

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                      **self.chat_template_kwargs)
        except Exception as exc:  # jinja2's TemplateError, raise_exception(...) of templates that know no tool role
            raise ConfigError(
                f"rollout.multi_turn: the chat template cannot render tool messages after an assistant turn "
                f"({type(exc).__name__}: {exc}); it cannot be used for multi-turn rollouts") from exc

    def _tail(self, outputs: Sequence[str], later_round: bool = False) -> str:
        """What the template writes after the (last) assistant turn's content when tool messages with
        `outputs` follow it, through the next assistant turn's opening. `later_round`: the assistant turn
        is the second one, after a first round of tool messages."""
        messages = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _MODEL}]
        model = _MODEL
        if later_round:
            messages += _tool_messages([_EARLIER]) + [{"role": "assistant", "content": _MODEL_LATER}]
            model = _MODEL_LATER
        full = self._render(messages + _tool_messages(outputs), generation_prompt=True)
        # Once in the stand-in conversation (a tool output that prints it too is cut after the first: the
        # assistant turn comes before the tool messages).
        if model not in full or full.count(model) != 1 and not any(model in t for t in outputs):
            raise ConfigError(
                "rollout.multi_turn: the chat template renders an earlier turn differently once tool messages follow "
                f"(the assistant turn's text {model!r} is not in its rendering {full!r} once); it cannot be used "
                "for multi-turn rollouts")
        return full.split(model, 1)[1]

    def _check_tool_turn(self, one: str, two: str) -> None:
        """Refuses a template without one tool turn to append after the model's turn: one that leaves
        tool messages out or renders them before the assistant turn, or whose tool turn after a later
        assistant turn is another text than after the first (the same text is appended every round)."""
        marks = ["MEGARLTOOLOUTPUT0X", "MEGARLTOOLOUTPUT1X"]
        if marks[0] not in one and self._tail(["0"]) == self._tail(["1"]):
            raise ConfigError(
                "rollout.multi_turn: the chat template does not render tool messages after the assistant turn "
                f"(after it: {one!r}); it cannot be used for multi-turn rollouts")
        for outputs, tail in ((marks[:1], one), (marks, two)):
            later = self._tail(outputs, later_round=True)
            if later != tail:
                raise ConfigError(
                    "rollout.multi_turn: the chat template renders the tool turn after a later assistant turn otherwise "
                    f"than after the first ({later!r} instead of {tail!r}); it cannot be used for multi-turn rollouts")

    def text(self, outputs: Sequence[str], ended_on: int | None = None) -> str:
        """The text appended after an assistant turn, for these tool outputs. `ended_on`: the id of the
        turn's last token (None: the tokenizer's EOS); when it is the template's end-of-turn token, the
        text starts after it (the model wrote it), else with it (the turn is closed as the template
        closes it)."""
        tail = self._tail(outputs)
        if self.end_of_turn is not None and self._last_token(ended_on) == self.end_of_turn \
                and tail.startswith(self.end_of_turn):
            tail = tail[len(self.end_of_turn):]
        return tail

    def _last_token(self, ended_on: int | None) -> str | None:
        return self.tokenizer.eos_token if ended_on is None else self.tokenizer.convert_ids_to_tokens(int(ended_on))

    def _shown(self, output: str, mark: str = "MEGARLTOOLOUTPUT0X") -> str | None:
        """How the template writes `output` in a tool message (JSON-escaped by Llama 3.x's templates);
        None when that cannot be told from its rendering. `mark`: a text that `output` does not hold."""
        before, _, after = self._tail([mark]).partition(mark)
        shown = self._tail([output])
        if len(shown) < len(before) + len(after) or not shown.startswith(before) or not shown.endswith(after):
            return None
        return shown[len(before):len(shown) - len(after)]

    # -- tokenisation -------------------------------------------------------------------------

    def _ids(self, text: str, split: bool = False) -> list[int]:
        if split:
            return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _special_id(self, token_id: int | None) -> int | None:
        if token_id is None:
            return None
        token = self.tokenizer.convert_ids_to_tokens(int(token_id))
        return int(token_id) if token is not None and self._ids(token) == [int(token_id)] else None

    def _after_special(self, text: str, anchor: int) -> list[int] | None:
        """`text` tokenised as it is right after the special token `anchor` (its ids there)."""
        ids = self._ids(self.tokenizer.convert_ids_to_tokens(anchor) + text)
        return ids[1:] if ids[:1] == [anchor] else None

    def _mid_text(self, text: str, split: bool) -> list[int]:
        """`text` tokenised as it is after other text (no leading "▁" of a SentencePiece tokenizer that
        marks the start of a text)."""
        for context in _CONTEXTS:
            head = self._ids(context, split)
            ids = self._ids(context + text, split)
            if head and ids[:len(head)] == head:
                return ids[len(head):]
        return self._ids(text, split)

    def _learn_boundaries(self) -> None:
        """Whether a text is tokenised the same on its own, after a special token and after other text
        (byte-level BPE: yes; a SentencePiece tokenizer that prepends "▁" to a text or to each stretch
        between special tokens: no). `_fresh_after_special`: after a special token as on its own."""
        probes = ("x", " x", "\nx", "x y")
        alone = [self._ids(p) for p in probes]
        after = [self._after_special(p, self._anchor) if self._anchor is not None else None for p in probes]
        mid = [self._mid_text(p, False) for p in probes]
        self._fresh_after_special = after == alone
        self._independent = alone == mid and (self._anchor is None or after == alone)

    def _continue(self, text: str, split: bool, after_special: int | None) -> list[int]:
        """Ids of `text` in the conversation: after the special token `after_special`, or after other
        text (None); `split`: special-token parsing off (a tool output)."""
        if not text:
            return []
        if self._independent:
            return self._ids(text, split)
        if after_special is not None:
            if not split:
                ids = self._after_special(text, after_special)
                if ids is not None:
                    return ids
            if self._fresh_after_special:
                return self._ids(text, split)
        return self._mid_text(text, split)

    def _template_added(self, count: int, ended_on: int | None) -> Counter:
        """The added tokens (with their number) of the template's own text around `count` outputs."""
        key = (count, self._last_token(ended_on) == self.end_of_turn)
        if key not in self._template_tokens:
            text = self.text([f"MEGARLTOOLOUTPUT{i}X" for i in range(count)], ended_on)
            self._template_tokens[key] = Counter(i for i in self._ids(text) if i in self._added)
        return self._template_tokens[key]

    def encode(self, outputs: Sequence[str], ended_on: int | None = None) -> list[int]:
        """Ids of `text(outputs, ended_on)`, as the tokenizer tokenises them after the turn's last token
        (so a SentencePiece tokenizer puts no "▁" of a text's start there, and an output JSON-escaped by
        the template is tokenised escaped). A tool output that prints an added token's text
        (`<|im_end|>`, `<|im_start|>assistant`) reaches the model as plain text, so that it cannot close
        its turn or open another: the template's text is then tokenised with its special tokens and each
        output on its own with special-token parsing off."""
        text = self.text(outputs, ended_on)
        last = ended_on if ended_on is not None else getattr(self.tokenizer, "eos_token_id", None)
        start = self._special_id(last) if last is not None else None
        ids = self._continue(text, False, start)
        if Counter(i for i in ids if i in self._added) == self._template_added(len(outputs), ended_on):
            return ids
        return self._piecewise(outputs, ended_on, text, start) or ids

    def _piecewise(self, outputs: Sequence[str], ended_on: int | None, text: str, start: int | None) -> list[int] | None:
        """Ids of `text` with the template's text and each output tokenised apart (outputs with special
        tokens as text); None when the outputs cannot be told apart in the template's text."""
        joined = "".join(outputs)
        k = 0
        while any(f"MEGARL{k}TOOLOUTPUT{i}X" in joined for i in range(len(outputs))):
            k += 1
        marks = [f"MEGARL{k}TOOLOUTPUT{i}X" for i in range(len(outputs))]
        rendered = self.text(marks, ended_on)
        if any(rendered.count(mark) != 1 for mark in marks):
            return None
        pieces: list[tuple[str, bool]] = []
        for mark, output in zip(marks, outputs):
            before, rendered = rendered.split(mark, 1)
            shown = output if self._verbatim else self._shown(output, mark)
            if shown is None:
                return None
            pieces += [(before, False), (shown, True)]
        pieces.append((rendered, False))
        if "".join(piece for piece, _ in pieces) != text:
            return None
        ids: list[int] = []
        after = start
        for piece, split in pieces:
            part = self._continue(piece, split, after)
            ids += part
            if part:
                after = part[-1] if part[-1] in self._added else None
        return ids


def retokenize_mismatch(tokenizer: Any, ids: Sequence[int]) -> bool:
    """Whether decoding `ids` and encoding the text again gives other ids (a trainer that re-tokenised
    the conversation would then train on tokens the model never produced)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    return list(tokenizer.encode(text, add_special_tokens=False)) != list(ids)
