"""Tool-call parsers: the assistant's decoded text -> (content, calls, errors), by chat format.

`TOOL_PARSERS` maps a format key to a parser function; `parse_tool_calls(text, "hermes")` looks it up. A
parser never raises on model output: each malformed call becomes one entry of `errors` (counted as
`tool/parse_errors`, and shown to the model by the loop if it chooses), and the well-formed calls of the
same message still run.

`hermes` is the format of Hermes-2-Pro, Qwen2.5 and Qwen3 chat templates (verl's `HermesToolParser`):

    Let me compute that.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*7"}}
    </tool_call>

Deviations from verl's parser: `arguments` given as a JSON string holding an object is accepted (some models
emit OpenAI's wire format), a missing `arguments` means `{}`, and an unclosed `<tool_call>` at the end (a
response cut at the length limit) is an error rather than silently ignored text.

Each error of a built-in parser is a `ParseError`: a str that also knows its position among the message's
calls, so that `in_call_order(calls, errors)` gives the loop the calls and errors in the order the model wrote
them, and the model gets one answer per call in that order (as verl's and OpenAI's tool messages are).

`tool_messages` and `assistant_message` build the chat messages the loop appends before the next turn.

The registry is a dict with the same checks as `stages.core.registry.Registry` (duplicate keys, unknown key
lists the valid ones); importing that module would import torch into tool servers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from stages.tools.base import ToolCall, ToolResponse

ParseResult = tuple[str, list[ToolCall], list[str]]
Parser = Callable[[str], ParseResult]

TOOL_PARSERS: dict[str, Parser] = {}
SNIPPET_CHARS = 60  # of a malformed call, in its error text


def register_parser(key: str) -> Callable[[Parser], Parser]:
    """Decorator adding a parser under `key`; a key registered twice is a ValueError."""

    def decorator(parser: Parser) -> Parser:
        if key in TOOL_PARSERS:
            raise ValueError(f"tool-call parser {key!r} is already registered; choose another key")
        TOOL_PARSERS[key] = parser
        return parser

    return decorator


def get_parser(key: str) -> Parser:
    """The parser for format `key`; an unknown key is a ValueError listing the valid ones."""
    if key not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {key!r}; valid keys: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[key]


class ParseError(str):
    """The error text of one malformed call, with `position`: its place among the message's calls (1-based,
    well-formed and malformed counted alike), the number the text itself gives."""

    position: int | None

    def __new__(cls, text: str, position: int | None = None) -> ParseError:
        error = super().__new__(cls, text)
        error.position = position
        return error


def in_call_order(calls: Sequence[ToolCall], errors: Sequence[str]) -> list[ToolCall | str]:
    """The message's calls and parse errors merged in the order the model wrote them.

    Errors with a `position` (ParseError) go to that place, the calls fill the others in their order; errors
    without one (a parser that returns plain strings) come after the calls.
    """
    ordered: list[ToolCall | str] = list(calls)
    placed = sorted((e for e in errors if getattr(e, "position", None) is not None), key=lambda e: e.position)
    for error in placed:  # ascending, so each insert lands at its final index
        ordered.insert(error.position - 1, error)
    return ordered + [e for e in errors if getattr(e, "position", None) is None]


def parse_tool_calls(text: str, format: str = "hermes") -> ParseResult:
    """Split an assistant message into its text content, its tool calls and the errors of malformed calls."""
    return get_parser(format)(text)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@register_parser("hermes")
def parse_hermes(text: str) -> ParseResult:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any number per message.

    The content is the text outside the blocks, stripped. Errors are numbered by the block's position
    (1-based) so that the model can tell which of several calls was wrong.
    """
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    pieces: list[str] = []
    position = 0
    for index, match in enumerate(_HERMES_BLOCK.finditer(text), start=1):
        pieces.append(text[position : match.start()])
        position = match.end()
        call_or_error = _hermes_call(match.group(1), index)
        if isinstance(call_or_error, ToolCall):
            calls.append(call_or_error)
        else:
            errors.append(ParseError(call_or_error, index))
    rest = text[position:]
    if "<tool_call>" in rest:
        start = rest.index("<tool_call>")
        number = len(calls) + len(errors) + 1
        errors.append(ParseError(f"tool call {number}: <tool_call> is not closed by </tool_call>", number))
        rest = rest[:start]
    pieces.append(rest)
    return "".join(pieces).strip(), calls, errors


def _hermes_call(body: str, index: int) -> ToolCall | str:
    """One block's JSON -> a ToolCall, or the error text for it."""
    where = f"tool call {index}"
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"{where}: invalid JSON ({exc.msg} at char {exc.pos}): {_snippet(body)}"
    except RecursionError:  # a degenerate sample's thousand nested brackets
        return f"{where}: invalid JSON (nested too deeply): {_snippet(body)}"
    if not isinstance(payload, dict):
        return f"{where}: expected a JSON object with 'name' and 'arguments', got {_snippet(body)}"
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return f"{where}: missing 'name' (a non-empty string): {_snippet(body)}"
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's wire format: the arguments object serialized as a string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return f"{where} ({name}): 'arguments' is a string that is not JSON: {_snippet(payload['arguments'])}"
    if not isinstance(arguments, dict):
        return f"{where} ({name}): 'arguments' must be a JSON object, got {_snippet(json.dumps(arguments))}"
    return ToolCall(name=name, arguments=arguments)


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SNIPPET_CHARS else text[: SNIPPET_CHARS - 3] + "..."


def tool_messages(
    results: Sequence[ToolResponse | str], calls: Sequence[ToolCall] | None = None
) -> list[dict[str, Any]]:
    """Chat messages for tool results, in call order: `{"role": "tool", "content": text, "name": ...}`.

    `name` is set when `calls` is given (one per result); Qwen's template ignores it, others (Llama 3.1,
    Mistral) render it.
    """
    if calls is not None and len(calls) != len(results):
        raise ValueError(f"tool_messages got {len(results)} results for {len(calls)} calls; pass one per call")
    messages = []
    for i, result in enumerate(results):
        text = result.text if isinstance(result, ToolResponse) else result
        message: dict[str, Any] = {"role": "tool", "content": text}
        if calls is not None:
            message["name"] = calls[i].name
        messages.append(message)
    return messages


def assistant_message(content: str, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The assistant turn with OpenAI-style `tool_calls`, which templates such as Qwen's re-render."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": call.name, "arguments": call.arguments}} for call in calls
        ]
    return message
