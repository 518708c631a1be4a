"""The built-in calculator tool: arithmetic expressions parsed and evaluated without ``eval``.

An expression is parsed with ``ast`` in eval mode and walked: numbers (int, float, and
``1_000`` style literals), ``+ - * / // % **``, unary ``+ -`` and parentheses; nothing
else (names, calls, attributes, subscripts, comparisons, strings) is accepted. Integers stay
exact (Python's big integers), so a model asking for 123456789 * 987654321 gets the exact
product; ``/`` is true division. Limits keep a hostile or runaway expression from taking the
job's CPU or memory: the text length, the nesting depth, the size of an exponent and the
number of digits of any intermediate integer.

Errors come back as :class:`ToolError` with a message the model can read (the environment
turns it into an error observation).
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Union

from megarl.environments.tool import ToolError

Number = Union[int, float]

MAX_CHARS = 512
MAX_DEPTH = 64
MAX_EXPONENT = 4096  # |b| in a ** b
MAX_DIGITS = 4096  # decimal digits of any integer the evaluation makes

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _check_size(value: Number) -> Number:
    if isinstance(value, int) and value and math.log10(abs(value)) >= MAX_DIGITS:
        raise ToolError(f"result has more than {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not a finite number")
    return value


def _eval(node: ast.AST, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise ToolError(f"expression nested deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise ToolError(f"exponent {right} is larger than {MAX_EXPONENT}")
            if isinstance(left, int) and isinstance(right, int) and left not in (0, 1, -1):
                if right * math.log10(abs(left)) >= MAX_DIGITS:  # decided before computing it
                    raise ToolError(f"result has more than {MAX_DIGITS} digits")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result is too large") from None
        if isinstance(value, complex):  # (-8) ** 0.5
            raise ToolError("result is not a real number")
        return _check_size(value)
    raise ToolError(f"not arithmetic: {ast.unparse(node)!r} (numbers, + - * / // % ** and parentheses only)")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; ToolError saying what is wrong with it."""
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_CHARS:
        raise ToolError(f"expression longer than {MAX_CHARS} characters")
    text = text.replace("^", "**").replace("×", "*").replace("÷", "/")  # what models write
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"cannot parse {expression!r}: {exc.msg}") from None
    return _eval(tree.body, 0)


def format_number(value: Number) -> str:
    """An exact integer as digits; a float as Python prints it, integral floats without '.0'."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)


class Calculator:
    """``{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}`` -> ``"84"``."""

    name = "calculator"
    description = "Evaluates an arithmetic expression exactly: numbers, + - * / // % ** and parentheses."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "for example 12 * (3 + 4)"}},
        "required": ["expression"],
    }

    def __call__(self, arguments: dict) -> str:
        if set(arguments) != {"expression"}:
            raise ToolError(f"calculator takes one argument, 'expression'; got {sorted(arguments)}")
        return format_number(evaluate(arguments["expression"]))
