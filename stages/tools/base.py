"""The tool interface of verl's multi-turn rollouts: an OpenAI function schema, a per-trajectory lifecycle
(`create` -> `execute`* -> `calc_reward` -> `release`) and argument validation against the schema.

Deviations from verl's `verl/tools/base_tool.py`:

- `execute` returns one `ToolResponse(text, reward, metrics)` instead of a `(response, reward, metrics)`
  tuple, and `create` returns only the instance id.
- Arguments are validated against the schema before a tool sees them (`validate_arguments`), so every tool
  gets the same error text for a missing or mistyped argument, naming the argument; verl leaves this to
  each tool.
- `BaseTool` keeps a per-instance state dict (`self.instances`), filled by `create` and dropped by
  `release`, because almost every tool needs one.

Validation covers what models get wrong in practice: missing required arguments, unexpected ones (when
the schema sets `additionalProperties: false`), the JSON types string/number/integer/boolean/array/
object/null (also as a list of types), `enum`, and `items`/`properties` recursively. It is not a complete
JSON-schema validator (no `pattern`, `minimum`, `oneOf`, `$ref`).
"""

from __future__ import annotations

import contextlib
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class ToolFunction(BaseModel):
    """The `function` part of an OpenAI tool schema."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, description="Name the model calls the tool by.")
    description: str = Field(default="", description="What the tool does, shown to the model.")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON schema of the arguments: an object with `properties` and `required`.",
    )
    strict: bool = Field(default=False, description="OpenAI's strict mode flag; kept for compatibility.")

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, parameters: dict[str, Any]) -> dict[str, Any]:
        parameters = {"type": "object", "properties": {}, **parameters}  # a copy: the caller's dict stays
        if parameters["type"] != "object":
            raise ValueError(f"parameters.type must be 'object', got {parameters['type']!r}")
        properties = parameters["properties"]
        if not isinstance(properties, dict):
            raise ValueError(  # noqa: TRY004 - pydantic turns only ValueError into a ValidationError
                f"parameters.properties must be a mapping of name -> schema, got {properties!r}")
        required = parameters.get("required", [])
        missing = [name for name in required if name not in properties] if isinstance(required, list) else None
        if missing is None or missing:
            raise ValueError(
                f"parameters.required must list names from parameters.properties ({sorted(properties)}), "
                f"got {required!r}"
            )
        for name, schema in properties.items():
            _check_property_schema(name, schema)
        return parameters


def _check_property_schema(name: str, schema: Any) -> None:
    """A property's `type` must be JSON-schema types we validate, so a typo (`str`) fails at load time."""
    if not isinstance(schema, dict):
        raise ValueError(  # noqa: TRY004 - pydantic turns only ValueError into a ValidationError
            f"parameters.properties.{name} must be a mapping (a JSON schema), got {schema!r}")
    types = schema.get("type", [])
    unknown = [t for t in (types if isinstance(types, list) else [types]) if t not in JSON_TYPES]
    if unknown:
        raise ValueError(f"parameters.properties.{name}.type {unknown} unknown; use one of {list(JSON_TYPES)}")


class ToolSchema(BaseModel):
    """An OpenAI function tool schema: `{"type": "function", "function": {name, description, parameters}}`.

    This is what chat templates render into the system prompt (`tools=[schema.to_openai()]`).
    """

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = Field(default="function", description="Always 'function'.")
    function: ToolFunction = Field(description="Name, description and argument schema.")

    def to_openai(self) -> dict[str, Any]:
        """The plain dict for `tokenizer.apply_chat_template(tools=...)` and HTTP."""
        schema = self.model_dump()
        if not schema["function"]["strict"]:
            del schema["function"]["strict"]  # most chat templates and servers never set it
        return schema


@dataclass
class ToolCall:
    """One call the model asked for: a tool name and its arguments (already parsed from JSON)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolResponse:
    """What a tool call gives back: the text the model sees, a step reward and numeric metrics."""

    text: str
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


def validate_arguments(schema: ToolSchema, arguments: Any) -> str | None:
    """None when `arguments` fit the schema, else an error text naming every bad argument.

    The text is meant for the model (it comes back as the tool's response), so it says what was
    expected: `error: tool 'python': missing required argument 'code' (string)`.
    """
    function = schema.function
    if not isinstance(arguments, dict):
        return f"error: tool {function.name!r}: arguments must be a JSON object, got {_type_name(arguments)}"
    problems = _check_object(arguments, function.parameters, path="")
    if not problems:
        return None
    return f"error: tool {function.name!r}: " + "; ".join(problems)


def _check_object(value: dict[str, Any], schema: dict[str, Any], path: str) -> list[str]:
    properties: dict[str, Any] = schema.get("properties", {})
    problems = []
    for name in schema.get("required", []):
        if name not in value:
            expected = properties.get(name, {}).get("type", "any type")
            problems.append(f"missing required argument {path + name!r} ({expected})")
    for name, item in value.items():
        if name in properties:
            problems += _check_value(item, properties[name], path + name)
        elif schema.get("additionalProperties", True) is False:
            allowed = ", ".join(sorted(properties)) or "none"
            problems.append(f"unexpected argument {path + name!r} (allowed: {allowed})")
    return problems


def _check_value(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    types = schema.get("type")
    if types is not None:
        types = types if isinstance(types, list) else [types]
        if not any(_is_type(value, t) for t in types):
            return [f"argument {path!r} must be {' or '.join(types)}, got {_type_name(value)} {_short(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"argument {path!r} must be one of {schema['enum']}, got {_short(value)}"]
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [p for i, item in enumerate(value) for p in _check_value(item, schema["items"], f"{path}[{i}]")]
    if isinstance(value, dict) and "properties" in schema:
        return _check_object(value, schema, path + ".")
    return []


def _is_type(value: Any, json_type: str) -> bool:
    """JSON-schema type check; bool is not a number, and 3.0 is an integer (JSON has one number type)."""
    if json_type == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python_types = {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}
    return isinstance(value, python_types[json_type])


def _type_name(value: Any) -> str:
    names = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array", dict: "object"}
    return names.get(type(value), "null" if value is None else type(value).__name__)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class BaseTool(ABC):
    """A tool with verl's lifecycle. One object serves many trajectories, each with its own instance id.

    Subclasses implement `execute`; they override `create`/`calc_reward`/`release` when an instance holds
    state (a sandbox session, a score). `config` is the tool's config from YAML (a dict; subclasses
    validate it with their own pydantic model), `tool_schema` what the model sees.

    Args:
        config: Tool-specific settings (`config:` in the tools YAML).
        tool_schema: The OpenAI schema; None means the class's `default_schema()`.
    """

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: ToolSchema | dict | None = None):
        self.config = dict(config or {})
        if tool_schema is None:
            tool_schema = self.default_schema()
        self.schema = tool_schema if isinstance(tool_schema, ToolSchema) else ToolSchema.model_validate(tool_schema)
        self.instances: dict[str, dict[str, Any]] = {}

    @classmethod
    def default_schema(cls) -> ToolSchema:
        """The schema used when the YAML gives none; tools without a natural default must be given one."""
        raise ValueError(f"{cls.__qualname__} has no default schema; give `tool_schema` in the tools config")

    @property
    def name(self) -> str:
        return self.schema.function.name

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        """Start an instance for one trajectory; returns its id (a new uuid4 when None is given).

        `create_kwargs` are per-sample data (verl's `tools_kwargs[name]["create_kwargs"]`, e.g. the
        ground truth); the base class stores them in `self.instances[id]["create_kwargs"]`.
        """
        instance_id = instance_id or uuid.uuid4().hex
        self.instances[instance_id] = {"create_kwargs": create_kwargs, "reward": 0.0}
        return instance_id

    @abstractmethod
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolResponse:
        """Run one call with validated `parameters`; the text is what the model sees next."""

    own_timeout_s: float | None = None  # a wall-clock limit the tool enforces itself (see tools.calls)

    def slot(self) -> contextlib.AbstractAsyncContextManager:
        """What a call waits for before its timeout starts (the base class: nothing)."""
        return contextlib.nullcontext()

    async def calc_reward(self, instance_id: str) -> float:
        """The trajectory-level reward this instance contributes (the base class: its stored `reward`, 0 unless the
        tool sets it). The loop adds it to the step rewards `execute` returned, so a tool that also keeps its step
        rewards here counts them twice."""
        return float(self.instances.get(instance_id, {}).get("reward", 0.0))

    async def release(self, instance_id: str) -> None:
        """Free the instance's state; releasing an unknown or released id is a no-op (idempotent)."""
        self.instances.pop(instance_id, None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

