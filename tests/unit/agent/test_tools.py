"""Tools: schema checks, argument checks, the calculator's evaluator and rewards, the code tool."""

from __future__ import annotations

import pytest

from megarl.agent.sandbox import SandboxLimits
from megarl.agent.tools import CalculatorTool, PythonTool, ToolSet, check_schema, evaluate_arithmetic

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("expression, value", [
    ("3+4", 7), ("2*(3+4)-1", 13), ("7/2", 3.5), ("7//2", 3), ("-7 % 3", 2), ("2**10", 1024), ("1.5*4", 6.0),
])
def test_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert evaluate_arithmetic(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "Call is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("'a' * 3", "Constant is not allowed"),
    ("9**9**9", "exponent"),
    ("10**60 * 10**60", "longer than 100 digits"),
    ("1e308 * 10", "not finite"),
    ("3 +", "not an arithmetic expression"),
])
def test_calculator_refuses_everything_else(expression: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        evaluate_arithmetic(expression)


def test_tool_calls_check_arguments_and_turn_failures_into_text() -> None:
    tools = ToolSet.from_names(["calculator"])
    assert tools.call("e1", "calculator", {"expression": "3+4"}).text == "7"
    missing = tools.call("e1", "calculator", {})
    assert missing.error == "bad_arguments" and "missing argument 'expression'" in missing.text
    typed = tools.call("e1", "calculator", {"expression": 7, "extra": 1})
    assert "must be string, got int" in typed.text and "unknown argument 'extra'" in typed.text
    assert tools.call("e1", "calculator", {"expression": "1/0"}).error == "invalid_expression"
    assert tools.call("e1", "search", {}).error == "unknown_tool"
    with pytest.raises(ValueError, match="unknown tool 'search'; built in: \\['calculator'"):
        ToolSet.from_names(["search"])


def test_calculator_reward_follows_the_last_result() -> None:
    calc = CalculatorTool()
    calc.create("e1", ground_truth=12)
    calc.call("e1", {"expression": "3*4"})
    calc.create("e2", ground_truth=12)
    calc.call("e2", {"expression": "3+4"})
    assert (calc.calc_reward("e1"), calc.calc_reward("e2")) == (1.0, 0.0)
    calc.release("e1")
    assert calc.calc_reward("e1") == 0.0


def test_schema_checks() -> None:
    with pytest.raises(ValueError, match='"type": "function"'):
        check_schema({"name": "calculator"})
    bad_type = {"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"x": {"type": "float"}}}}}
    with pytest.raises(ValueError, match="parameter 'x' has type 'float'"):
        check_schema(bad_type)
    bad_required = {"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {}, "required": ["x"]}}}
    with pytest.raises(ValueError, match="required parameters \\['x'\\]"):
        check_schema(bad_required)


def test_code_interpreter_answers_with_output_or_the_limit() -> None:
    tool = PythonTool(limits=SandboxLimits(cpu_seconds=1, wall_seconds=5))
    assert tool.call("e", {"code": "print(sum(range(101)))"}).text == "5050"
    failed = tool.call("e", {"code": "raise KeyError('k')"})
    assert failed.error == "exit_code" and "KeyError: 'k'" in failed.text
    looped = tool.call("e", {"code": "while True: pass"})
    assert looped.error == "cpu_time" and "stopped by the cpu_time limit" in looped.text
