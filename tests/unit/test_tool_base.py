"""The tool interface: schema checks, argument validation, the lifecycle, run_tool_call's guarantees (bad
arguments, raising and hanging tools become error texts), metrics counting, and the calculator."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pydantic
import pytest

from stages.tools.base import BaseTool, ToolCall, ToolResponse, ToolSchema, validate_arguments
from stages.tools.calculator import CalculatorTool, calculate
from stages.tools.calls import call_tool, run_tool_call

SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search a corpus.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "top_k": {"type": "integer"},
                "weight": {"type": "number"},
                "exact": {"type": "boolean"},
                "mode": {"type": "string", "enum": ["bm25", "dense"]},
                "ids": {"type": "array", "items": {"type": "integer"}},
                "filters": {"type": "object", "properties": {"year": {"type": "integer"}}},
                "note": {"type": ["string", "null"]},
            },
            "required": ["query"],
        },
    },
}


class Recorder(BaseTool):
    """A tool that records its calls and can raise, hang or misbehave on request."""

    def __init__(self, schema: dict = SCHEMA):
        super().__init__({}, schema)
        self.calls: list[dict[str, Any]] = []

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolResponse:
        self.calls.append(parameters)
        behaviour = parameters["query"]
        if behaviour == "raise":
            raise KeyError("no such index")
        if behaviour == "hang":
            await asyncio.sleep(60)
        if behaviour == "wrong":
            return "a bare string"  # type: ignore[return-value]
        self.instances[instance_id]["reward"] += 0.5
        return ToolResponse(text=f"found {behaviour}", reward=0.5, metrics={"search/hits": 3.0})


def run(coro):
    return asyncio.run(coro)


def test_schema_round_trip_and_strict_left_out():
    schema = ToolSchema.model_validate(SCHEMA)
    assert schema.to_openai() == SCHEMA  # strict=False is not written back
    assert Recorder().name == "search"


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"type": "array"}, "parameters.type must be 'object'"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}, "required must list"),
        ({"type": "object", "properties": {"a": {"type": "str"}}}, "properties.a.type ['str'] unknown"),
        ({"type": "object", "properties": {"a": "string"}}, "properties.a must be a mapping"),
    ],
)
def test_bad_schema_names_the_field(parameters, message):
    with pytest.raises(pydantic.ValidationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ToolSchema.model_validate({"type": "function", "function": {"name": "t", "parameters": parameters}})


def test_bad_tool_name():
    with pytest.raises(pydantic.ValidationError, match="name"):
        ToolSchema.model_validate({"function": {"name": "has space"}})


def test_valid_arguments_pass():
    schema = ToolSchema.model_validate(SCHEMA)
    arguments = {"query": "q", "top_k": 3.0, "weight": 1, "exact": False, "mode": "dense", "ids": [1, 2],
                 "filters": {"year": 2020}, "note": None, "extra": "allowed: no additionalProperties"}
    assert validate_arguments(schema, arguments) is None  # 3.0 is a JSON integer, 1 a number


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({}, "missing required argument 'query' (string)"),
        ({"query": 3}, "argument 'query' must be string, got integer 3"),
        ({"query": "q", "top_k": 2.5}, "argument 'top_k' must be integer, got number 2.5"),
        ({"query": "q", "weight": True}, "argument 'weight' must be number, got boolean True"),
        ({"query": "q", "mode": "fuzzy"}, "argument 'mode' must be one of ['bm25', 'dense'], got 'fuzzy'"),
        ({"query": "q", "ids": [1, "2"]}, "argument 'ids[1]' must be integer, got string '2'"),
        ({"query": "q", "filters": {"year": "x"}}, "argument 'filters.year' must be integer"),
        ({"query": "q", "note": 1}, "argument 'note' must be string or null"),
        (["q"], "arguments must be a JSON object, got array"),
    ],
)
def test_bad_arguments_name_the_argument(arguments, expected):
    error = validate_arguments(ToolSchema.model_validate(SCHEMA), arguments)
    assert error is not None and error.startswith("error: tool 'search': ")
    assert expected in error


def test_all_problems_reported_and_unexpected_when_closed():
    schema = CalculatorTool().schema  # additionalProperties: false
    error = validate_arguments(schema, {"expr": "1+1"})
    assert "missing required argument 'expression' (string)" in error
    assert "unexpected argument 'expr' (allowed: expression)" in error


def test_lifecycle():
    tool = Recorder()

    async def scenario():
        generated = await tool.create(ground_truth="42")
        given = await tool.create("traj-7")
        assert given == "traj-7" and len(generated) == 32 and generated != given
        assert tool.instances[generated]["create_kwargs"] == {"ground_truth": "42"}
        await run_tool_call(tool, given, ToolCall("search", {"query": "a"}), timeout_s=5)
        await run_tool_call(tool, given, ToolCall("search", {"query": "b"}), timeout_s=5)
        assert await tool.calc_reward(given) == 1.0  # two steps of 0.5
        assert await tool.calc_reward(generated) == 0.0
        await tool.release(given)
        await tool.release(given)  # idempotent
        assert given not in tool.instances and generated in tool.instances

    run(scenario())


def test_run_tool_call_success_metrics():
    tool = Recorder()
    instance = run(tool.create())
    response = run(run_tool_call(tool, instance, ToolCall("search", {"query": "cats"}), timeout_s=5))
    assert response.text == "found cats" and response.reward == 0.5
    assert response.metrics["error"] == 0.0 and response.metrics["timeout"] == 0.0
    assert response.metrics["search/hits"] == 3.0 and response.metrics["latency_s"] >= 0


def test_bad_arguments_never_reach_the_tool():
    tool = Recorder()
    response = run(run_tool_call(tool, "i", ToolCall("search", {"top_k": 1}), timeout_s=5))
    assert tool.calls == []
    assert response.text == "error: tool 'search': missing required argument 'query' (string)"
    assert response.metrics["error"] == 1.0 and response.reward == 0.0


def test_raising_tool_becomes_text():
    response = run(run_tool_call(Recorder(), "i", ToolCall("search", {"query": "raise"}), timeout_s=5))
    assert response.text == "error: tool 'search' failed: KeyError: 'no such index'"
    assert response.metrics == {"error": 1.0, "timeout": 0.0, "latency_s": pytest.approx(0, abs=1)}


def test_hanging_tool_times_out():
    start = time.monotonic()
    response = run(run_tool_call(Recorder(), "i", ToolCall("search", {"query": "hang"}), timeout_s=0.2))
    assert response.text == "error: tool 'search' timed out after 0.2 s"
    assert response.metrics["timeout"] == 1.0 and response.metrics["error"] == 1.0
    assert time.monotonic() - start < 30  # bounded: the tool would sleep 60 s


def test_wrong_return_type_becomes_text():
    response = run(run_tool_call(Recorder(), "i", ToolCall("search", {"query": "wrong"}), timeout_s=5))
    assert response.text == "error: tool 'search' returned str, not a ToolResponse"


def test_unknown_tool_and_missing_instance():
    tools = {"search": Recorder(), "calculator": CalculatorTool()}
    result = run(call_tool(tools, {"search": "i"}, ToolCall("browse", {}), timeout_s=5))
    assert result.response.text == "error: unknown tool 'browse'; available tools: calculator, search"
    assert result.error and not result.known_tool
    with pytest.raises(ValueError, match="'calculator' has no instance id"):
        run(call_tool(tools, {"search": "i"}, ToolCall("calculator", {"expression": "1"}), timeout_s=5))


def test_call_results_flag_errors_and_timeouts():
    """What the loop counts (tool/errors, tool/timeouts, tool/unknown_tool) from each call's result."""
    tools = {"search": Recorder(), "calculator": CalculatorTool()}
    ids = {"search": "s", "calculator": "c"}
    run(tools["search"].create("s"))
    calls = [
        ToolCall("search", {"query": "ok"}),
        ToolCall("search", {"query": "raise"}),
        ToolCall("search", {"query": "hang"}),
        ToolCall("calculator", {"expression": "2*3"}),
        ToolCall("browse", {}),
    ]

    async def scenario():
        return [await call_tool(tools, ids, call, timeout_s=0.2) for call in calls]

    results = run(scenario())
    assert [(r.error, r.timeout, r.known_tool) for r in results] == [
        (False, False, True), (True, False, True), (True, True, True), (False, False, True), (True, False, False)]
    assert results[2].response.metrics["latency_s"] >= 0.2  # the timed-out call


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("12*(3+4)", "84"),  # 12*7
        ("7/2", "3.5"),
        ("7//2", "3"),
        ("-7//2", "-4"),  # floor, as in Python
        ("7 % 3", "1"),
        ("2**10", "1024"),
        ("-(2**3) + +1", "-7"),
        ("1.5*4", "6.0"),
    ],
)
def test_calculator_values(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("1/0", "error: division by zero"),
        ("2^3", "error: use ** for powers, ^ is not allowed"),
        ("__import__('os')", "error: unsupported element"),
        ("x + 1", "error: unsupported element 'x'"),
        ("9**9**9", "error: exponent 387420489 is too large"),
        ("(2**4000)**9999", "error: result too large"),
        ("(-8)**0.5", "error: result is not a real number"),
        ("(1", "error: invalid expression"),
        ("1+" * 300 + "1", "error: expression longer than 500 characters"),
    ],
)
def test_calculator_errors(expression, error):
    assert calculate(expression).startswith(error)


def test_calculator_tool():
    tool = CalculatorTool()
    response = run(run_tool_call(tool, "i", ToolCall("calculator", {"expression": "6*7"}), timeout_s=5))
    assert response.text == "42" and response.metrics["calculator/error"] == 0.0
    with pytest.raises(ValueError, match="takes no config"):
        CalculatorTool({"precision": 3})
