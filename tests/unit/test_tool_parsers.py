"""Hermes tool-call parsing: well-formed calls, several per message, and every malformed form as an error
entry (never an exception) while the message's other calls still parse; the chat messages for results."""

from __future__ import annotations

import pytest

from stages.tools.base import ToolCall, ToolResponse
from stages.tools.parsers import (
    TOOL_PARSERS,
    assistant_message,
    get_parser,
    in_call_order,
    parse_tool_calls,
    register_parser,
    tool_messages,
)


def test_single_call_and_content():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
    content, calls, errors = parse_tool_calls(text)
    assert content == "Let me compute."
    assert calls == [ToolCall("calculator", {"expression": "12*7"})]
    assert errors == []


def test_several_calls_keep_order_and_text_between():
    text = (
        'A <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> B '
        '<tool_call>{"name": "b", "arguments": {"y": [1, 2]}}</tool_call> C'
    )
    content, calls, errors = parse_tool_calls(text, "hermes")
    assert content == "A  B  C"
    assert [call.name for call in calls] == ["a", "b"] and calls[1].arguments == {"y": [1, 2]}
    assert errors == []


def test_no_calls_leaves_text():
    assert parse_tool_calls("  The answer is 84.  ") == ("The answer is 84.", [], [])


@pytest.mark.parametrize(
    ("block", "error"),
    [
        ('{"name": "a", "arguments": {"x": 1}', "tool call 2: invalid JSON ("),
        ('["a", {}]', "tool call 2: expected a JSON object with 'name' and 'arguments'"),
        ('{"arguments": {"x": 1}}', "tool call 2: missing 'name' (a non-empty string)"),
        ('{"name": "", "arguments": {}}', "tool call 2: missing 'name'"),
        ('{"name": "a", "arguments": [1, 2]}', "tool call 2 (a): 'arguments' must be a JSON object, got [1, 2]"),
        ('{"name": "a", "arguments": "x=1"}', "tool call 2 (a): 'arguments' is a string that is not JSON: x=1"),
        ('{"name": "a", "arguments": "[1]"}', "tool call 2 (a): 'arguments' must be a JSON object"),
        ("[" * 100_000 + "]" * 100_000, "tool call 2: invalid JSON (nested too deeply)"),  # a repetition loop
        ('{"name": "a", "arguments": "' + "[" * 100_000 + '"}', "tool call 2 (a): 'arguments' is a string that"),
    ],
)
def test_malformed_call_is_an_error_and_others_still_parse(block, error):
    text = (
        '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
        f"<tool_call>{block}</tool_call>"
        '<tool_call>{"name": "ok2", "arguments": {"k": "v"}}</tool_call>'
    )
    content, calls, errors = parse_tool_calls(text)
    assert [call.name for call in calls] == ["ok", "ok2"]
    assert len(errors) == 1 and errors[0].startswith(error), errors
    assert content == ""


def test_arguments_as_json_string_and_missing_arguments():
    text = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
    )
    _, calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("a", {"x": 2}), ToolCall("now", {})] and errors == []


def test_unclosed_call_at_the_end():
    text = 'Done <tool_call>{"name": "a", "arguments": {}}</tool_call> and <tool_call>{"name": "b", "argu'
    content, calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("a", {})]
    assert errors == ["tool call 2: <tool_call> is not closed by </tool_call>"]
    assert content == "Done  and"


def test_errors_keep_their_place_among_the_calls():
    """Blocks: bad JSON, call a, no name, call b, unclosed: in_call_order gives them back in that order."""
    text = ('<tool_call>{oops</tool_call><tool_call>{"name": "a"}</tool_call><tool_call>{}</tool_call>'
            '<tool_call>{"name": "b"}</tool_call><tool_call>{"name": "c"')
    _, calls, errors = parse_tool_calls(text)
    assert [error.position for error in errors] == [1, 3, 5]
    ordered = in_call_order(calls, errors)
    assert [item.name if isinstance(item, ToolCall) else item[:11] for item in ordered] == [
        "tool call 1", "a", "tool call 3", "b", "tool call 5"]
    # a parser that gives plain strings (no position): its errors come after the calls
    assert in_call_order([ToolCall("a")], ["bad", "worse"]) == [ToolCall("a"), "bad", "worse"]


def test_long_malformed_call_is_shortened():
    _, _, errors = parse_tool_calls("<tool_call>" + "x" * 1000 + "</tool_call>")
    assert len(errors[0]) < 150 and errors[0].endswith("...")


def test_registry_errors():
    assert get_parser("hermes") is TOOL_PARSERS["hermes"]
    with pytest.raises(ValueError, match="unknown tool-call parser 'qwen'; valid keys: hermes"):
        parse_tool_calls("x", "qwen")
    with pytest.raises(ValueError, match="'hermes' is already registered"):
        register_parser("hermes")(lambda text: (text, [], []))


def test_tool_messages():
    calls = [ToolCall("calculator", {"expression": "1"}), ToolCall("python", {"code": "print(2)"})]
    messages = tool_messages([ToolResponse("1"), "2\n"], calls)
    assert messages == [
        {"role": "tool", "content": "1", "name": "calculator"},
        {"role": "tool", "content": "2\n", "name": "python"},
    ]
    assert tool_messages(["x"]) == [{"role": "tool", "content": "x"}]
    with pytest.raises(ValueError, match="got 1 results for 2 calls"):
        tool_messages(["x"], calls)


def test_assistant_message():
    calls = [ToolCall("calculator", {"expression": "1+1"})]
    assert assistant_message("thinking", calls) == {
        "role": "assistant",
        "content": "thinking",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+1"}}}],
    }
    assert assistant_message("final", []) == {"role": "assistant", "content": "final"}
