"""Plain Python functions as tools: `function_tool(fn)` derives the OpenAI schema from the signature and the
docstring, so a tool is one typed, documented function:

    def lookup(city: str, units: Literal["metric", "imperial"] = "metric") -> str:
        '''Current weather of a city.

        Args:
            city: City name, e.g. "Paris".
            units: Unit system of the answer.
        '''

Schema rules: the first docstring paragraph is the description; Google-style `Args:` lines give parameter
descriptions (continuation lines are joined); parameters without a default are required; type hints map to
JSON types (`str` string, `int` integer, `float` number, `bool` boolean, `list[X]`/`tuple` array,
`dict` object, `Literal[...]` enum, `X | None` = X or null); a parameter without a hint accepts any JSON
value. `additionalProperties` is false, because an unexpected keyword would be a TypeError in the call.

The function may be sync (run in a thread of its own, so it does not block the event loop, and one that
outlives its timeout does not hold up the rollout: `in_own_thread`) or async, and
returns `str`, `(str, reward)` or a `ToolResponse`. The reward is a step reward, which the loop adds to the
trajectory's tool reward; `calc_reward` adds nothing more.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import re
import threading
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from stages.tools.base import BaseTool, ToolFunction, ToolResponse, ToolSchema

_SIMPLE_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
                 tuple: "array", dict: "object", type(None): "null"}
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Return|Yields|Raises|Example|Examples|Note|Notes):\s*$")
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


class FunctionTool(BaseTool):
    """A tool that calls a Python function with the model's arguments as keywords.

    Args:
        fn: The function (sync or async).
        name: Tool name; default `fn.__name__`.
        description: Overrides the docstring's first paragraph.
        tool_schema: A full schema instead of the derived one (its parameters must match `fn`).
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None, description: str | None = None,
                 tool_schema: ToolSchema | dict | None = None):
        self.fn = fn
        schema = tool_schema if tool_schema is not None else function_schema(fn, name, description)
        super().__init__({}, schema)
        self._integer_params = {
            key for key, prop in self.schema.function.parameters["properties"].items() if prop.get("type") == "integer"
        }

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolResponse:
        arguments = {
            key: int(value) if key in self._integer_params and isinstance(value, float) else value
            for key, value in parameters.items()
        }  # JSON's 3.0 is a valid integer; give the function the int its hint asks for
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**arguments)
        else:
            result = await in_own_thread(self.fn, **arguments)
        return _as_response(result, self.name)  # its reward is a step reward: the loop adds it, once


async def in_own_thread(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a daemon thread of its own. A call that outlives its timeout (a thread cannot be
    stopped) runs on in the background without holding anything up: `asyncio.to_thread` ran it in the event loop's
    default executor, which `asyncio.run` joins when it ends (a batch of rollouts waited for the hung function,
    forever for one that never returns) and whose threads the engine calls share (hung calls starved them)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():  # else: cancelled (timed out); nobody reads it
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            outcome = (context.run(fn, *args, **kwargs), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop has closed: the call had timed out long ago
            pass

    threading.Thread(target=run, name=f"function-tool-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return await future


def function_tool(fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> FunctionTool:
    """`fn` as a tool, its schema from signature and docstring (see the module docstring)."""
    return FunctionTool(fn, name=name, description=description)


def _as_response(result: Any, name: str) -> ToolResponse:
    if isinstance(result, ToolResponse):
        return result
    if isinstance(result, str):
        return ToolResponse(text=result)
    if (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], str)
            and isinstance(result[1], (int, float)) and not isinstance(result[1], bool)):
        return ToolResponse(text=result[0], reward=float(result[1]))
    raise TypeError(f"function tool {name!r} returned {type(result).__name__}; return str or (str, reward)")


def function_schema(fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> ToolSchema:
    """The OpenAI schema of `fn`; a ValueError names the parameter whose hint has no JSON type."""
    where = f"function tool {getattr(fn, '__qualname__', fn)!r}"
    summary, arg_docs = parse_docstring(inspect.getdoc(fn) or "")
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError) as exc:
        raise ValueError(f"{where}: its type hints cannot be resolved ({exc}); import the names they use") from None
    properties: dict[str, Any] = {}
    required = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ValueError(f"{where}: parameter {param.name!r} is {param.kind.description}; tools are called "
                             "with keyword arguments only, so use named parameters")
        prop = json_type(hints[param.name], f"{where}, parameter {param.name!r}") if param.name in hints else {}
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    function = ToolFunction(name=name or fn.__name__, description=description or summary, parameters=parameters)
    return ToolSchema(function=function)


def json_type(hint: Any, where: str) -> dict[str, Any]:
    """JSON schema for a type hint (see the module docstring for the mapping)."""
    if hint is Any:
        return {}
    if hint in _SIMPLE_TYPES:
        return {"type": _SIMPLE_TYPES[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        kinds = sorted({_SIMPLE_TYPES[type(arg)] for arg in args if type(arg) in _SIMPLE_TYPES})
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [json_type(arg, where) for arg in args]
        if any("type" not in option for option in options):
            return {}
        kinds = [option["type"] for option in options]
        return {"type": kinds[0] if len(kinds) == 1 else kinds}
    if origin in (list, set, frozenset) or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return {"type": "array", "items": json_type(args[0], where)}  # list[X], tuple[X, ...]
    if origin is tuple:  # tuple[X, Y]: items of different types, which the validator does not check
        return {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    raise ValueError(f"{where}: type hint {hint!r} has no JSON type; use str, int, float, bool, list, dict, "
                     "Literal or X | None")


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph as one line, {parameter: description} from a Google-style `Args:` section)."""
    lines = inspect.cleandoc(doc).splitlines() if doc else []
    paragraph: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        paragraph.append(line.strip())
    return " ".join(paragraph), _arg_docs(lines)


def _arg_docs(lines: list[str]) -> dict[str, str]:
    docs: dict[str, str] = {}
    in_args, arg_indent, current = False, None, None
    for line in lines:
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if _SECTION.match(stripped) and indent == 0:
            in_args, arg_indent, current = stripped.split(":")[0] in ("Args", "Arguments", "Parameters"), None, None
            continue
        if not in_args or not stripped:
            continue
        if arg_indent is None:
            arg_indent = indent
        match = _ARG_LINE.match(stripped)
        if indent == arg_indent and match:
            current = match.group(1).lstrip("*")
            docs[current] = match.group(3).strip()
        elif indent > arg_indent and current is not None:
            docs[current] = f"{docs[current]} {stripped}".strip()
    return docs
