"""Safe evaluation of integer arithmetic expressions (``ast``, never ``eval``).

Allowed: integer literals, ``+ - * /`` (exact rational division), unary ``+``/``-``, parentheses.
Anything else (names, calls, powers, floats, strings ...) is rejected.
"""

from __future__ import annotations

import ast
from fractions import Fraction

MAX_EXPRESSION_CHARS = 256

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class ExpressionError(ValueError):
    """The text is not an allowed arithmetic expression, or it divides by zero."""


def parse_expression(text: str) -> ast.expr:
    """Parse and check ``text``; raise ExpressionError unless it only uses allowed syntax."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as exc:
        raise ExpressionError(f"not an expression: {exc.msg}") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp):
            if type(node.op) not in _BINARY:
                raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.UAdd, ast.USub)):
                raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")
        elif isinstance(node, ast.Constant):
            if type(node.value) is not int:
                raise ExpressionError(f"only integers are allowed, got {node.value!r}")
        elif not isinstance(node, (ast.operator, ast.unaryop)):
            raise ExpressionError(f"{type(node).__name__} is not allowed")
    return tree


def integer_literals(tree: ast.expr) -> list[int]:
    """The integer literals of a parsed expression, in source order."""
    literals = [node for node in ast.walk(tree) if isinstance(node, ast.Constant)]
    return [node.value for node in sorted(literals, key=lambda n: (n.lineno, n.col_offset))]


def evaluate(tree: ast.expr) -> Fraction:
    """Exact value of a tree accepted by :func:`parse_expression`."""
    if isinstance(tree, ast.Constant):
        return Fraction(tree.value)
    if isinstance(tree, ast.UnaryOp):
        value = evaluate(tree.operand)
        return -value if isinstance(tree.op, ast.USub) else value
    if isinstance(tree, ast.BinOp):
        left, right = evaluate(tree.left), evaluate(tree.right)
        if isinstance(tree.op, ast.Div) and right == 0:
            raise ExpressionError("division by zero")
        return _BINARY[type(tree.op)](left, right)
    raise ExpressionError(f"{type(tree).__name__} is not allowed")
