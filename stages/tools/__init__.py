"""Tools for multi-turn (agentic) rollouts: the model writes a tool call, the loop runs it and appends the
result as a `tool` message, and the next turn continues from there (issue 14).

This package is the library the agent loop calls; it holds no loop itself.

    base        ToolSchema (OpenAI function schema), ToolCall, ToolResponse, BaseTool (verl's lifecycle:
                create -> execute* -> calc_reward -> release), validate_arguments.
    calls       run_tool_call / call_tool: execute a parsed call so that bad arguments, unknown tools,
                raising or hanging tools become error texts; ToolCallResult (error, timeout: what the loop counts).
    parsers     TOOL_PARSERS (`hermes`: <tool_call>{...}</tool_call>): text -> (content, calls, errors);
                in_call_order(calls, errors) for one answer per call in the model's order;
                tool_messages / assistant_message for the chat template.
    functions   function_tool(fn): a typed, documented Python function as a tool.
    registry    load_tools(yaml path | list): tools by name from verl's tools YAML.
    sandbox     PythonTool (`python`): code in a fresh process with rlimits, a timeout that kills the
                process group, an output cap, no network (network namespace or audit hook).
    calculator  CalculatorTool (`calculator`): safe arithmetic through `ast`.
    server      python -m stages.tools.server: tools over HTTP (aiohttp).
    remote      RemoteTool / remote_tools(url): the client, with timeouts and safe retries.

One trajectory, as calls:

    tools = load_tools("recipes/tools.yaml")
    ids = {name: await tool.create(**sample_kwargs.get(name, {})) for name, tool in tools.items()}
    content, calls, errors = parse_tool_calls(decoded_text, "hermes")
    results = [await call_tool(tools, ids, call, timeout_s=30) for call in calls]
    messages += [assistant_message(content, calls), *tool_messages([r.response for r in results], calls)]
    ...
    reward += sum([await tool.calc_reward(ids[name]) for name, tool in tools.items()])
    for name, tool in tools.items(): await tool.release(ids[name])

Truncating a tool's text to `max_tool_response_length` is the loop's job (it knows the tokenizer); the
sandbox bounds its output in bytes itself.
"""

from stages.tools.base import BaseTool, ToolCall, ToolFunction, ToolResponse, ToolSchema, validate_arguments
from stages.tools.calculator import CalculatorTool, calculate
from stages.tools.calls import ToolCallResult, call_tool, run_tool_call
from stages.tools.functions import FunctionTool, function_tool
from stages.tools.parsers import (
    TOOL_PARSERS,
    ParseError,
    assistant_message,
    in_call_order,
    parse_tool_calls,
    tool_messages,
)
from stages.tools.registry import load_tools
from stages.tools.sandbox import PythonTool, SandboxConfig

__all__ = [
    "TOOL_PARSERS", "BaseTool", "CalculatorTool", "FunctionTool", "ParseError", "PythonTool", "SandboxConfig",
    "ToolCall", "ToolCallResult", "ToolFunction", "ToolResponse", "ToolSchema", "assistant_message",
    "calculate", "call_tool", "function_tool", "in_call_order", "load_tools", "parse_tool_calls", "run_tool_call",
    "tool_messages", "validate_arguments",
]
