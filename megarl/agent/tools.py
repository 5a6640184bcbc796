"""Tools a policy can call: an OpenAI function schema each, and a per-episode life cycle.

Life cycle of one tool in one episode (the names of verl's tool interface, so datasets written for
it carry over: `extra_info.tools_kwargs.<tool>.{create_kwargs,execute_kwargs,calc_reward_kwargs,
release_kwargs}`):
  create(episode, **create_kwargs)  -> per-episode state (e.g. the expected answer)
  execute(episode, arguments, **execute_kwargs) -> ToolResult (text for the model, or an error)
  calc_reward(episode, **calc_reward_kwargs) -> float (added to the episode's score)
  release(episode, **release_kwargs)

`Tool.call` checks the model's arguments against the schema first: a missing or mistyped argument
is a tool error the model reads, never an exception in the trainer.
"""

from __future__ import annotations

import ast
import importlib
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megarl.agent.sandbox import SandboxLimits, run_python

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "object": (dict,),
    "array": (list,),
}


@dataclass
class ToolResult:
    text: str
    error: Optional[str] = None  # set when the call failed; `text` then says why, for the model
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def check_schema(schema: dict[str, Any]) -> None:
    """An OpenAI function tool schema: {"type": "function", "function": {"name", "description",
    "parameters": {"type": "object", "properties": {...}, "required": [...]}}}."""
    fn = schema.get("function") if schema.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f'a tool schema is {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}, '
                         f"got {schema!r}")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if params.get("type") != "object" or not isinstance(params.get("properties", {}), dict):
        raise ValueError(f"tool {fn['name']}: parameters must be a JSON-schema object with properties")
    for name, prop in params.get("properties", {}).items():
        if prop.get("type") not in _JSON_TYPES:
            raise ValueError(f"tool {fn['name']}: parameter {name!r} has type {prop.get('type')!r}; "
                             f"valid: {sorted(_JSON_TYPES)}")
    missing = [r for r in params.get("required", []) if r not in params.get("properties", {})]
    if missing:
        raise ValueError(f"tool {fn['name']}: required parameters {missing} are not among its properties")


def argument_problems(schema: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """What is wrong with `arguments` for this schema (empty when they fit)."""
    params = schema["function"].get("parameters", {})
    props = params.get("properties", {})
    problems = [f"missing argument {r!r}" for r in params.get("required", []) if r not in arguments]
    for name, value in arguments.items():
        if name not in props:
            problems.append(f"unknown argument {name!r} (expected {sorted(props)})")
            continue
        want = props[name]["type"]
        ok = isinstance(value, _JSON_TYPES[want]) and not (want in ("integer", "number") and isinstance(value, bool))
        if not ok:
            problems.append(f"argument {name!r} must be {want}, got {type(value).__name__}")
        elif "enum" in props[name] and value not in props[name]["enum"]:
            problems.append(f"argument {name!r} must be one of {props[name]['enum']}")
    return problems


class Tool:
    """Base class: subclasses set `schema` and implement `execute`; the rest is optional."""

    schema: dict[str, Any] = {}

    def __init__(self, timeout_s: float = 10.0) -> None:
        check_schema(self.schema)
        self.timeout_s = timeout_s
        self.state: dict[str, dict[str, Any]] = {}

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def create(self, episode: str, **kwargs: Any) -> None:
        self.state[episode] = dict(kwargs)

    def execute(self, episode: str, arguments: dict[str, Any], **kwargs: Any) -> ToolResult:
        raise NotImplementedError

    def calc_reward(self, episode: str, **kwargs: Any) -> float:
        return 0.0

    def release(self, episode: str, **kwargs: Any) -> None:
        self.state.pop(episode, None)

    def call(self, episode: str, arguments: dict[str, Any], **kwargs: Any) -> ToolResult:
        """`execute` after the argument check, timed; an exception is a tool error for the model."""
        problems = argument_problems(self.schema, arguments)
        if problems:
            return ToolResult(f"error: {self.name}: " + "; ".join(problems), error="bad_arguments")
        start = time.perf_counter()
        try:
            result = self.execute(episode, arguments, **kwargs)
        except Exception as err:  # the tool's failure is the model's information, not the trainer's crash
            result = ToolResult(f"error: {self.name} failed: {type(err).__name__}: {err}", error="exception")
        result.seconds = time.perf_counter() - start
        return result


# ------------------------------------------------------------------------------- calculator
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_DIGITS = 100


def evaluate_arithmetic(expression: str) -> int | float:
    """+ - * / // % ** and parentheses over int and float literals; nothing else is evaluated."""
    if len(expression) > 500:
        raise ValueError("expression longer than 500 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {err.msg}") from None

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} larger than {MAX_EXPONENT}")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, int) and len(str(abs(value))) > MAX_DIGITS:
                raise ValueError(f"result longer than {MAX_DIGITS} digits")
            if isinstance(value, complex):
                raise ValueError("complex result")
            return value
        raise ValueError(f"{type(node).__name__} is not allowed (numbers, + - * / // % ** and parentheses only)")

    value = ev(tree)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not finite")
    return value


class CalculatorTool(Tool):
    """Evaluates an arithmetic expression. `calc_reward`: 1 when the last result equals the
    episode's `ground_truth` (create_kwargs in verl's layout, as `tools/prepare_*.py --tools` and the
    arithmetic_tools task write it), else 0."""

    schema = {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

    def execute(self, episode: str, arguments: dict[str, Any], **kwargs: Any) -> ToolResult:
        try:
            value = evaluate_arithmetic(arguments["expression"])
        except (ValueError, ZeroDivisionError, OverflowError) as err:
            return ToolResult(f"error: {err}", error="invalid_expression")
        text = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
        self.state.setdefault(episode, {})["last"] = text
        return ToolResult(text)

    def calc_reward(self, episode: str, **kwargs: Any) -> float:
        state = self.state.get(episode, {})
        return float("ground_truth" in state and state.get("last") == str(state["ground_truth"]))


class PythonTool(Tool):
    """Runs a Python script in `megarl.agent.sandbox` (limits per call); answers with its output."""

    schema = {"type": "function", "function": {
        "name": "code_interpreter", "description": "Run a Python 3 script; its printed output is returned.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}

    def __init__(self, timeout_s: float = 10.0, limits: Optional[SandboxLimits] = None) -> None:
        super().__init__(timeout_s)
        self.limits = limits or SandboxLimits(wall_seconds=timeout_s)

    def execute(self, episode: str, arguments: dict[str, Any], **kwargs: Any) -> ToolResult:
        run = run_python(arguments["code"], self.limits)
        if run.stopped_by is not None:
            return ToolResult(f"error: stopped by the {run.stopped_by} limit\n{run.stderr[-500:]}".rstrip(),
                              error=run.stopped_by, timed_out=run.stopped_by == "wall_time")
        if run.exit_code != 0:
            return ToolResult(f"{run.stdout}{run.stderr[-1000:]}".rstrip() or f"exit code {run.exit_code}",
                              error="exit_code")
        return ToolResult(run.stdout.rstrip())


BUILTIN_TOOLS: dict[str, type[Tool]] = {"calculator": CalculatorTool, "code_interpreter": PythonTool}


@dataclass
class ToolSet:
    """The tools of a run by name, with their schemas for the chat template."""

    tools: dict[str, Tool] = field(default_factory=dict)

    @classmethod
    def from_names(cls, names: list[str] | tuple[str, ...], timeout_s: float = 10.0) -> "ToolSet":
        """Built-in tools by name, or a `Tool` subclass as "package.module:ClassName" (its schema's
        name is the tool's name)."""
        tools: dict[str, Tool] = {}
        for name in names:
            tool_cls = BUILTIN_TOOLS.get(name) or (import_tool(name) if ":" in name else None)
            if tool_cls is None:
                raise ValueError(f"unknown tool {name!r}; built in: {sorted(BUILTIN_TOOLS)}, or give a Tool "
                                 "subclass as 'package.module:ClassName'")
            tool = tool_cls(timeout_s=timeout_s)
            if tool.name in tools:
                raise ValueError(f"two tools are named {tool.name!r} (from {name!r})")
            tools[tool.name] = tool
        return cls(tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def call(self, episode: str, name: str, arguments: dict[str, Any], **kwargs: Any) -> ToolResult:
        if name not in self.tools:
            return ToolResult(f"error: there is no tool {name!r}; available: {sorted(self.tools)}", error="unknown_tool")
        return self.tools[name].call(episode, arguments, **kwargs)


def import_tool(path: str) -> type[Tool]:
    """The Tool subclass `path` names ("package.module:ClassName"); ValueError saying why not."""
    module_name, _, attr = path.partition(":")
    try:
        tool_cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"tool {path!r}: cannot import it ({err})") from None
    if not (isinstance(tool_cls, type) and issubclass(tool_cls, Tool)):
        raise ValueError(f"tool {path!r} is not a subclass of megarl.agent.tools.Tool")
    return tool_cls
