"""A calculator tool for ``env.tools: [reward.envs.calculator:calc]``: integer arithmetic with ``+``, ``-``,
``*`` and parentheses.

The expression is parsed, never run: only digits, the three operators, parentheses and blanks may appear
(checked first), ``ast.parse`` turns the text into a tree, and ``evaluate`` walks it accepting integer
literals, unary ``+``/``-`` and the three binary operators, nothing else (no names, calls, attributes, powers,
division). The length is bounded (``MAX_EXPRESSION_CHARS``), which bounds the result's size: at most about
that many digits.
"""

from __future__ import annotations

import ast
import operator
import re

MAX_EXPRESSION_CHARS = 200
_CHARS = re.compile(r"[0-9+\-*() \t]*")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> int:
    """The value of an integer expression with ``+``, ``-``, ``*`` and parentheses (``"12 * (3 + 4) - 5"``: 79).

    Raises:
        TypeError: ``expression`` is not a string.
        ValueError: longer than ``MAX_EXPRESSION_CHARS``, a character other than digits, ``+ - * ( )`` and
            blanks, or not a well-formed expression of them (``2 3``, ``2 ** 3``, ``()``, ``007``); the message
            shows the expression.
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is {len(expression)} characters long, more than {MAX_EXPRESSION_CHARS}")
    if not _CHARS.fullmatch(expression):
        raise ValueError(f"only integers, + - * and parentheses are allowed: {expression!r}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError):
        raise ValueError(f"not a well-formed expression: {expression!r}") from None
    return _value(tree.body, expression)


def _value(node: ast.AST, expression: str) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, expression))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_value(node.left, expression), _value(node.right, expression))
    raise ValueError(f"only integers, + - * and parentheses are allowed: {expression!r}")


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and * and parentheses.

    Args:
        expression: the expression to evaluate, for example "12 * (3 + 4) - 5"

    Returns:
        The value, as a decimal integer.
    """
    return str(evaluate(expression))
