"""Run one parsed tool call so that nothing the model or a tool does can raise into the agent loop, and
count what happened.

`run_tool_call` validates the arguments against the tool's schema, awaits `execute` under a wall-clock
timeout and turns every failure into an error text the model sees next:

    error: tool 'python': missing required argument 'code' (string)
    error: tool 'search' timed out after 5 s
    error: tool 'calculator' failed: ZeroDivisionError: division by zero

The response's metrics carry `error` and `timeout` (0/1; a tool may set them itself: the python tool's own
limits) and `latency_s`. The tool_agent loop counts them per sample, summed per step: `tool/calls`, `tool/errors`,
`tool/timeouts`, `tool/parse_errors`, `tool/unknown_tool`, `tool/refused`, `tool/nan_rewards` and per known tool
`tool/<name>/calls|errors|timeouts`; each call's latency is in the `turns` table (`latency_s`).

The timeout starts once the tool has a slot (`tool.slot()`: the python tool's sandbox runs `max_concurrent`
programs at a time), so a call that waits for a free process is not cut for the time others ran. A tool that
enforces its own wall-clock limit (`tool.own_timeout_s`: the sandbox's `timeout_s` and the wait for the kill) gets
at least that long, so the output so far and the tool's note on the limit reach the model instead of a bare
timeout error.

A timed-out call is cancelled. A coroutine stops at its next await; a synchronous function (function tools)
runs in a daemon thread of its own, which cannot be stopped: it runs to its end in the background while the
rollout goes on and ends without waiting for it, so tools that can hang on CPU belong in a subprocess (the
sandbox) or a remote server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from stages.tools.base import BaseTool, ToolCall, ToolResponse, validate_arguments

logger = logging.getLogger(__name__)


async def run_tool_call(tool: BaseTool, instance_id: str, call: ToolCall, timeout_s: float) -> ToolResponse:
    """Execute `call` on `tool`'s instance; never raises for bad arguments, a raising or hanging tool.

    Args:
        tool: The tool named by `call.name`.
        instance_id: From `tool.create` for this trajectory.
        call: The parsed call.
        timeout_s: Wall-clock limit for `execute` (at least `tool.own_timeout_s`), from when it has a slot.

    Returns:
        The tool's response with metrics `error`, `timeout` (0.0 or 1.0) and `latency_s` added.
    """
    start = time.perf_counter()
    problem = validate_arguments(tool.schema, call.arguments)
    if problem is not None:
        return _failed(problem, start)
    timeout_s = max(timeout_s, tool.own_timeout_s or 0.0)
    try:
        async with tool.slot():
            response = await asyncio.wait_for(tool.execute(instance_id, call.arguments), timeout_s)
    except TimeoutError:
        logger.warning("tool %r timed out after %g s (instance %s)", tool.name, timeout_s, instance_id)
        return _failed(f"error: tool {tool.name!r} timed out after {timeout_s:g} s", start, timeout=True)
    except Exception as exc:  # any failure of a tool becomes text for the model, by contract
        logger.warning("tool %r raised %s: %s", tool.name, type(exc).__name__, exc, exc_info=True)
        return _failed(f"error: tool {tool.name!r} failed: {type(exc).__name__}: {exc}", start)
    if not isinstance(response, ToolResponse):
        return _failed(f"error: tool {tool.name!r} returned {type(response).__name__}, not a ToolResponse", start)
    metrics = {"error": 0.0, "timeout": 0.0, **response.metrics, "latency_s": time.perf_counter() - start}
    return ToolResponse(text=response.text, reward=response.reward, metrics=metrics)


def _failed(text: str, start: float, timeout: bool = False) -> ToolResponse:
    metrics = {"error": 1.0, "timeout": float(timeout), "latency_s": time.perf_counter() - start}
    return ToolResponse(text=text, reward=0.0, metrics=metrics)


@dataclass
class ToolCallResult:
    """One executed (or refused) call: what the model asked for and what it gets back."""

    call: ToolCall
    response: ToolResponse
    known_tool: bool = True

    @property
    def error(self) -> bool:
        return self.response.metrics.get("error", 0.0) > 0

    @property
    def timeout(self) -> bool:
        return self.response.metrics.get("timeout", 0.0) > 0


async def call_tool(
    tools: Mapping[str, BaseTool], instance_ids: Mapping[str, str], call: ToolCall, timeout_s: float
) -> ToolCallResult:
    """Dispatch `call` by name: an unknown name becomes an error text listing the tools there are.

    Args:
        tools: The trajectory's tools by name.
        instance_ids: The instance id of each tool for this trajectory (from `create`).
        call: The parsed call.
        timeout_s: Wall-clock limit for the call.

    Raises:
        ValueError: A known tool has no instance id (the caller did not `create` it): a bug, not bad input.
    """
    tool = tools.get(call.name)
    if tool is None:
        names = ", ".join(sorted(tools)) or "none"
        text = f"error: unknown tool {call.name!r}; available tools: {names}"
        return ToolCallResult(call, ToolResponse(text, metrics={"error": 1.0, "timeout": 0.0}), known_tool=False)
    if call.name not in instance_ids:
        raise ValueError(f"tool {call.name!r} has no instance id; call `create` for every tool of the trajectory")
    response = await run_tool_call(tool, instance_ids[call.name], call, timeout_s)
    return ToolCallResult(call, response)
