"""The tools `sssd chat --demo-tools` offers the model, run in the client: arithmetic and the
clock, so a tool loop can be tried against any server of a model with tool calls (Qwen2.5's
template: `sssd up --model qwen-coder-0.5b`)."""

from __future__ import annotations

import ast
import datetime
import json
import operator

DEMO_TOOLS = [
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression exactly "
        "(+ - * / // % ** and parentheses).",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "description": "e.g. (17 + 4) * 3"}},
            "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "utc_time", "description": "The current date and time in UTC.",
        "parameters": {"type": "object", "properties": {}}}},
]
MAX_ROUNDS = 5  # tool calls a user turn may take before the chat asks the user again

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
              ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 1000:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)[:60]}")


def run_tool(name: str, arguments: str) -> str:
    """The tool's result as text; an error is a result too (the model reads it)."""
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return "error: the arguments are not JSON"
    if name == "utc_time":
        return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    if name == "calculate":
        expression = args.get("expression") if isinstance(args, dict) else None
        if not isinstance(expression, str):
            return "error: expression (a string) is required"
        try:
            return str(_evaluate(ast.parse(expression, mode="eval").body))
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
            return f"error: {exc}"
    return f"error: no tool {name!r}"
