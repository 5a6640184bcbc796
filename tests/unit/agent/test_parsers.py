"""Tool-call parsing of one assistant turn: valid calls, several in a turn, malformed ones."""

from __future__ import annotations

import pytest

from megarl.agent.parsers import (HermesParser, ParsedTurn, ParseError, ToolCall, format_hermes, get_parser,
                                  register_parser)

pytestmark = pytest.mark.unit


def test_one_call_with_text_around_it() -> None:
    turn = HermesParser().parse('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
                                '{"expression": "3+4"}}\n</tool_call>')
    assert turn.calls == [ToolCall("calculator", {"expression": "3+4"})]
    assert turn.errors == [] and turn.content == "Let me compute."


def test_several_calls_in_one_turn_keep_their_order() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}</tool_call>'
            '<tool_call>{"name": "c"}</tool_call>')
    turn = HermesParser().parse(text)
    assert turn.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [1, 2]}), ToolCall("c", {})]
    assert turn.content == "and"


def test_no_call_is_plain_content() -> None:
    turn = HermesParser().parse("The answer is 7.")
    assert not turn.has_calls and turn.content == "The answer is 7."


@pytest.mark.parametrize("body, message", [
    ('{"name": "calculator", "arguments": {"expression": "3+4"}', "not valid JSON"),
    ('{"arguments": {"x": 1}}', 'needs a "name" string'),
    ('["calculator"]', 'needs a "name" string'),
    ('{"name": "calculator", "arguments": [1, 2]}', "must be an object, got list"),
    ('{"name": "calculator", "arguments": "not json"}', "is a string that is not JSON"),
    # what json.loads raises besides JSONDecodeError (a degenerate policy can write either)
    ('{"name": "c", "arguments": ' + "[" * 5000 + "]" * 5000 + "}", "cannot be read as JSON (RecursionError)"),
    ('{"name": "c", "arguments": {"x": ' + "1" * 5000 + "}}", "cannot be read as JSON (ValueError)"),
    ('{"name": "c", "arguments": "{\\"x\\": ' + "1" * 5000 + '}"}', "is a string that is not JSON"),
])
def test_malformed_calls_become_messages_for_the_model(body: str, message: str) -> None:
    turn = HermesParser().parse(f"<tool_call>{body}</tool_call><tool_call>{{\"name\": \"ok\"}}</tool_call>")
    assert turn.calls == [ToolCall("ok", {})]  # the good call after the bad one still counts
    assert len(turn.errors) == 1 and message in turn.errors[0].message and turn.errors[0].text == body


def test_calls_and_malformed_calls_keep_the_order_written() -> None:
    """Tool answers pair with calls by position, so the turn keeps good and bad calls in one order."""
    turn = HermesParser().parse('<tool_call>{"name": "a"}</tool_call><tool_call>{oops</tool_call>'
                                '<tool_call>{"name": "b"}</tool_call>')
    written = turn.in_order()
    assert written[0] == ToolCall("a", {}) and written[2] == ToolCall("b", {})
    assert written[1] == turn.errors[0] and "not valid JSON" in written[1].message
    # A parser that fills the lists itself (no `add`): its calls first, then its errors.
    by_hand = ParsedTurn(calls=[ToolCall("x", {})], errors=[ParseError("bad", "?")])
    assert by_hand.in_order() == [ToolCall("x", {}), ParseError("bad", "?")]


def test_unclosed_and_stray_tags() -> None:
    unclosed = HermesParser().parse('x <tool_call>{"name": "a"}')
    assert unclosed.calls == [] and "unclosed <tool_call>" in unclosed.errors[0].message
    assert unclosed.content == "x"
    stray = HermesParser().parse("done</tool_call>")
    assert "</tool_call> without <tool_call>" in stray.errors[0].message and stray.content == "done"


def test_round_trip_and_registry() -> None:
    call = ToolCall("calculator", {"expression": "2**5"})
    assert HermesParser().parse(format_hermes(call)).calls == [call]
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'; registered: .*hermes"):
        get_parser("xml")

    class Bracket:
        def parse(self, text: str):  # a format of one's own: [[name]]
            turn = HermesParser().parse("")
            turn.calls = [ToolCall(text.strip("[]"), {})] if text.startswith("[[") else []
            return turn

    register_parser("bracket", Bracket)
    assert get_parser("bracket").parse("[[clock]]").calls == [ToolCall("clock", {})]
