"""Load tools: from a YAML file in verl's format, or from a list of entries, tool objects and functions.

    tools:
      - class_name: stages.tools.calculator.CalculatorTool     # a dotted path ...
      - class_name: my_tools/search.py:SearchTool              # ... or a file (relative to the YAML) and a name
        config: {top_k: 3}                                     # the class's own settings
        tool_schema:                                           # OpenAI schema; optional when the class has
          type: function                                       # a default (calculator, python, functions)
          function: {name: search, description: ..., parameters: {...}}

`class_name` may also name a plain function, which becomes a `FunctionTool`. verl's `config.type: native` is
accepted and dropped; other types (verl's `mcp`) are refused. Every error is a ValueError naming the file,
the entry (`tools[2]`) and the fix; two tools with one name are an error (the model could not tell them
apart). Errors raised by the imported module's own code propagate unchanged.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pydantic
import yaml

from infra.imports import import_file
from stages.tools.base import BaseTool
from stages.tools.functions import FunctionTool, function_tool

__all__ = ["function_tool", "load_tools", "resolve_object"]

ENTRY_KEYS = ("class_name", "config", "tool_schema")


def load_tools(source: str | Path | Sequence[dict | BaseTool | Callable[..., Any]]) -> dict[str, BaseTool]:
    """Tools by name, from a YAML path or a list of YAML-style entries, `BaseTool` objects and functions.

    Raises:
        ValueError: The file is missing or not YAML, an entry is malformed, a class cannot be found or
            built, or two tools share a name.
    """
    if isinstance(source, (str, Path)):
        entries, origin, base_dir = _read_yaml(Path(source)), str(source), Path(source).resolve().parent
    else:
        entries, origin, base_dir = list(source), "tools list", Path.cwd()
    tools: dict[str, BaseTool] = {}
    where_of: dict[str, str] = {}
    for index, entry in enumerate(entries):
        where = f"{origin}: tools[{index}]"
        tool = _build(entry, where, base_dir)
        if tool.name in tools:
            raise ValueError(f"{where}: tool name {tool.name!r} is already used by {where_of[tool.name]}; "
                             "give one of them another name (tool_schema.function.name)")
        tools[tool.name], where_of[tool.name] = tool, where
    return tools


def _read_yaml(path: Path) -> list[Any]:
    if not path.is_file():
        raise ValueError(f"tools file {str(path)!r} not found; give the path of a YAML file with a `tools:` list")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"tools file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        raise ValueError(  # noqa: TRY004 - bad user input is a ValueError here (STYLE.md)
            f"tools file {str(path)!r} must hold a mapping with a `tools:` list of entries, "
                         f"got {type(data).__name__}")
    return data["tools"]


def _build(entry: Any, where: str, base_dir: Path) -> BaseTool:
    if isinstance(entry, BaseTool):
        return entry
    if inspect.isclass(entry) and issubclass(entry, BaseTool):
        return entry()
    if callable(entry):
        return function_tool(entry)
    if not isinstance(entry, dict):
        raise ValueError(  # noqa: TRY004 - bad user input is a ValueError here (STYLE.md)
            f"{where}: expected a mapping with class_name/config/tool_schema, got {entry!r}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown or "class_name" not in entry:
        raise ValueError(f"{where}: keys {sorted(entry)} are not valid; an entry has `class_name` (required), "
                         f"`config` and `tool_schema`")
    config = _native_config(entry.get("config") or {}, where)
    target = resolve_object(str(entry["class_name"]), where, base_dir)
    try:
        if inspect.isclass(target) and issubclass(target, BaseTool):
            return target(config=config, tool_schema=entry.get("tool_schema"))
        if inspect.isroutine(target):
            if config:
                raise ValueError(f"a function tool takes no config, got {sorted(config)}; remove `config`")
            return FunctionTool(target, tool_schema=entry.get("tool_schema"))
    except pydantic.ValidationError as exc:
        part = "tool_schema" if exc.title == "ToolSchema" else "config"
        raise ValueError(f"{where} ({entry['class_name']}): invalid {part}: {_describe(exc)}; fix the entry's "
                         f"`{part}`") from None
    except ValueError as exc:
        raise ValueError(f"{where} ({entry['class_name']}): {exc}") from exc
    raise ValueError(f"{where}: {entry['class_name']!r} is {type(target).__name__}, not a BaseTool subclass or a "
                     "function; point class_name at a tool class")


def _describe(exc: pydantic.ValidationError) -> str:
    """pydantic's errors on one line: `timeout: Extra inputs are not permitted (got 3)`."""
    return "; ".join(
        f"{'.'.join(map(str, error['loc'])) or 'value'}: {error['msg']} (got {_short(error['input'])})"
        for error in exc.errors()
    )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _native_config(config: Any, where: str) -> dict[str, Any]:
    """The config without verl's `type: native`; other tool types are not supported here."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: config must be a mapping, got {config!r}")  # noqa: TRY004 - user input
    config = dict(config)
    kind = config.pop("type", "native")
    if kind != "native":
        raise ValueError(f"{where}: config.type {kind!r} is not supported; only 'native' Python tools "
                         "(use stages.tools.remote.RemoteTool for tools on another machine)")
    return config


def resolve_object(spec: str, where: str, base_dir: Path | None = None) -> Any:
    """The object named by `pkg.mod.Name` or `path/to/file.py:Name` (a relative path from `base_dir`)."""
    if ":" in spec:
        file_part, _, attr = spec.rpartition(":")
        module = _module_from_file(file_part, where, base_dir or Path.cwd())
    else:
        module_name, _, attr = spec.rpartition(".")
        if not module_name:
            raise ValueError(f"{where}: class_name {spec!r} must be 'package.module.Name' or 'file.py:Name'")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise  # the module exists; an import inside it failed
            raise ValueError(f"{where}: cannot import module {module_name!r} of class_name {spec!r} "
                             f"({exc}); check the dotted path or give 'path/to/file.py:Name'") from None
    if not hasattr(module, attr):
        found = sorted(k for k, v in vars(module).items() if _is_tool_like(v) and not k.startswith("_"))
        raise ValueError(f"{where}: {module.__name__} has no {attr!r} (class_name {spec!r}); "
                         f"its tool classes and functions: {found}")
    return getattr(module, attr)


def _is_tool_like(value: Any) -> bool:
    return (inspect.isclass(value) and issubclass(value, BaseTool)) or inspect.isfunction(value)


def _module_from_file(file_part: str, where: str, base_dir: Path) -> Any:
    """Import a .py file once per process, under a name derived from its resolved path."""
    path = Path(file_part).expanduser()
    path = (path if path.is_absolute() else base_dir / path).resolve()
    if not path.is_file() or path.suffix != ".py":
        raise ValueError(f"{where}: tool file {file_part!r} not found (looked at {str(path)!r}); give a .py "
                         "path, relative to the tools YAML")
    return import_file(str(path), f"{where}: tool file")
