"""Tool-call parsers: find the tool calls in one assistant turn's text.

A parser never raises on what a model wrote: a malformed call becomes a `ParseError` with a
message meant for the model (it is sent back as the tool's answer), and the rest of the turn is
still parsed. Parsers are registered by name (`register_parser`); `hermes` is the
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format of Hermes and Qwen2.5/Qwen3.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParseError:
    message: str  # what was wrong, for the model to read
    text: str  # the offending call as written


@dataclass
class ParsedTurn:
    """The calls of one turn in the order written, the malformed ones, and the text around them.

    `written` holds both kinds in the order the model wrote them (`add` keeps it and the two lists):
    tool answers are matched to calls by position (Hermes/Qwen `<tool_response>` blocks carry no id),
    so they are given in that order. A parser that fills `calls` and `errors` itself, without `add`,
    gets its calls answered first and its errors after them."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)
    content: str = ""
    written: list[ToolCall | ParseError] = field(default_factory=list)

    def add(self, item: ToolCall | ParseError) -> None:
        """A call or a malformed call, the next one in the turn's text."""
        (self.calls if isinstance(item, ToolCall) else self.errors).append(item)
        self.written.append(item)

    def in_order(self) -> list[ToolCall | ParseError]:
        """Every call and malformed call of the turn in the order written (see the class doc)."""
        if len(self.written) == len(self.calls) + len(self.errors):
            return list(self.written)
        return [*self.calls, *self.errors]

    @property
    def has_calls(self) -> bool:
        return bool(self.calls or self.errors)


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class HermesParser:
    """`<tool_call>` JSON `</tool_call>` blocks; `arguments` an object or a JSON string of one."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        content: list[str] = []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:start])
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            if end < 0:
                raw = text[start:]
                turn.add(ParseError(f"unclosed {self.open_tag}: end the call with {self.close_tag}", raw))
                break
            raw = text[body_start:end]
            call = self._call(raw.strip())
            turn.add(call)
            pos = end + len(self.close_tag)
        stray = text.count(self.close_tag) - text.count(self.open_tag)
        if stray > 0:
            turn.add(ParseError(f"{self.close_tag} without {self.open_tag}", self.close_tag))
        turn.content = "".join(content).replace(self.close_tag, "").strip()
        return turn

    @staticmethod
    def _call(raw: str) -> ToolCall | ParseError:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as err:
            return ParseError(f"the tool call is not valid JSON ({err.msg} at character {err.pos}); write "
                              '{"name": "<tool>", "arguments": {...}}', raw)
        except (ValueError, RecursionError) as err:  # an integer past Python's digit limit, deep nesting
            return ParseError(f"the tool call cannot be read as JSON ({type(err).__name__}); write "
                              '{"name": "<tool>", "arguments": {...}}', raw)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return ParseError('the tool call needs a "name" string: {"name": "<tool>", "arguments": {...}}', raw)
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
                return ParseError(f'"arguments" of {obj["name"]} is a string that is not JSON', raw)
        if not isinstance(args, dict):
            return ParseError(f'"arguments" of {obj["name"]} must be an object, got {type(args).__name__}', raw)
        return ToolCall(obj["name"], args)


_PARSERS: dict[str, Callable[[], ToolCallParser]] = {"hermes": HermesParser}


def register_parser(name: str, factory: Callable[[], ToolCallParser]) -> None:
    """Add a tool-call format (a class or function returning an object with `parse(text)`)."""
    _PARSERS[name] = factory


def get_parser(name: str) -> ToolCallParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call format {name!r}; registered: {sorted(_PARSERS)}")
    return _PARSERS[name]()


# Used by tests and by tools that echo a call back: the canonical Hermes text of a call.
def format_hermes(call: ToolCall) -> str:
    return f"{HermesParser.open_tag}{json.dumps({'name': call.name, 'arguments': call.arguments})}{HermesParser.close_tag}"

