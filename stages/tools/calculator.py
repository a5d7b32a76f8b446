"""A `calculator` tool: exact arithmetic on one expression, evaluated by walking its `ast` (no `eval`).

Allowed: int and float literals, `+ - * / // % **`, unary `+ -`, parentheses. Results follow Python:
`7/2` is `3.5`, `7//2` is `3`, `6/3` is `2.0`. Anything else (names, calls, strings, `^`) is an error text
for the model, as are division by zero and numbers too large to be useful: an exponent above
`MAX_EXPONENT`, or an integer above `MAX_BITS` bits at any step, so that `9**9**9` costs nothing.
The value is Python's `repr` (`84`, `3.5`, `inf` for a float overflow in `*`).
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from stages.tools.base import BaseTool, ToolFunction, ToolResponse, ToolSchema

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 10_000
MAX_BITS = 4096  # about 1233 decimal digits

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
_HINTS = {ast.BitXor: "use ** for powers, ^ is not allowed"}


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is shown to the model."""


def calculate(expression: str) -> str:
    """The value of `expression` as text, or an `error: ...` text; never raises for bad input."""
    try:
        return repr(_evaluate(expression))
    except CalculatorError as exc:
        return f"error: {exc}"


def _evaluate(expression: str) -> int | float:
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"invalid expression ({exc.msg})") from None
    return _node(tree.body)


def _node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _node(node.left), _node(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        return _checked(value)
    if isinstance(node, ast.BinOp) and type(node.op) in _HINTS:
        raise CalculatorError(_HINTS[type(node.op)])
    raise CalculatorError(f"unsupported element {ast.unparse(node)!r}; use numbers, + - * / // % ** and ()")


def _check_power(base: float, exponent: float) -> None:
    """Refuse a power before computing it when its size alone would cost seconds (`(2**4000)**9999`)."""
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is too large (at most {MAX_EXPONENT})")
    if isinstance(base, int) and (abs(base).bit_length() - 1) * exponent > MAX_BITS:
        raise CalculatorError(f"result too large (more than {MAX_BITS} bits)")


def _checked(value: Any) -> int | float:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise CalculatorError("result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise CalculatorError(f"result too large (more than {MAX_BITS} bits)")
    return value


class CalculatorTool(BaseTool):
    """The `calculator` tool: `{"expression": "12*(3+4)"}` -> `"84"`. No state, no reward, no config."""

    @classmethod
    def default_schema(cls) -> ToolSchema:
        return ToolSchema(
            function=ToolFunction(
                name="calculator",
                description="Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
                parameters={
                    "type": "object",
                    "properties": {
                        "expression": {"type": "string", "description": "The expression, e.g. '12*(3+4)'."}
                    },
                    "required": ["expression"],
                    "additionalProperties": False,
                },
            )
        )

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: ToolSchema | dict | None = None):
        super().__init__(config, tool_schema)
        if self.config:
            raise ValueError(f"calculator tool takes no config, got {sorted(self.config)}; remove them")

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolResponse:
        text = calculate(str(parameters.get("expression", "")))
        return ToolResponse(text=text, metrics={"calculator/error": float(text.startswith("error:"))})
