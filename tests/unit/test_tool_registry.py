"""Loading tools: verl's YAML (dotted classes, files relative to the YAML, functions, `type: native`),
function tools (schema from hints and docstring, sync/async, rewards), and the errors, which name the file,
the entry and the fix."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path
from typing import Literal

import pytest

from stages.tools.base import BaseTool, ToolCall, ToolResponse
from stages.tools.calculator import CalculatorTool, calculate
from stages.tools.calls import run_tool_call
from stages.tools.functions import function_tool, parse_docstring
from stages.tools.registry import load_tools
from stages.tools.sandbox import PythonTool

USER_TOOLS = '''
from stages.tools.base import BaseTool, ToolResponse


class Search(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(f"{self.config['prefix']}{parameters['query']}")


def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()
'''


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def run(coro):
    return asyncio.run(coro)


def test_yaml_with_classes_files_and_functions(tmp_path):
    write(tmp_path / "lib" / "user_tools.py", USER_TOOLS)
    config = write(tmp_path / "tools.yaml", """
        tools:
          - class_name: stages.tools.calculator.CalculatorTool
            config: {type: native}
          - class_name: stages.tools.sandbox.PythonTool
            config: {timeout_s: 3, memory_mb: 256}
          - class_name: lib/user_tools.py:Search
            config: {prefix: "hit: "}
            tool_schema:
              type: function
              function:
                name: search
                description: Search the notes.
                parameters:
                  type: object
                  properties:
                    query: {type: string}
                  required: [query]
          - class_name: lib/user_tools.py:shout
          - class_name: stages.tools.calculator.calculate
        """)
    tools = load_tools(config)
    assert list(tools) == ["calculator", "python", "search", "shout", "calculate"]
    assert isinstance(tools["calculator"], CalculatorTool)
    assert isinstance(tools["python"], PythonTool) and tools["python"].sandbox.config.memory_mb == 256
    response = run(run_tool_call(tools["search"], "i", ToolCall("search", {"query": "q"}), 5))
    assert response.text == "hit: q"
    response = run(run_tool_call(tools["shout"], "i", ToolCall("shout", {"text": "hi"}), 5))
    assert response.text == "HI"
    assert tools["calculate"].schema.function.parameters["required"] == ["expression"]
    assert type(load_tools(config)["search"]) is type(tools["search"])  # the file is imported once


def test_list_of_objects_classes_and_functions():
    tools = load_tools([CalculatorTool(), PythonTool, calculate])
    assert list(tools) == ["calculator", "python", "calculate"]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("- class_name: stages.tools.calculator.Calculator", (
            r"tools\[0\]: stages.tools.calculator has no 'Calculator' \(class_name "
            r"'stages.tools.calculator.Calculator'\); its tool classes and functions: "
            r"\['BaseTool', 'CalculatorTool', 'calculate'\]")),
        ("- class_name: no_such_pkg.tools.Tool", r"tools\[0\]: cannot import module 'no_such_pkg.tools'"),
        ("- class_name: Calculator", r"must be 'package.module.Name' or 'file.py:Name'"),
        ("- class_name: missing.py:Tool", r"tools\[0\]: tool file 'missing.py' not found .*relative to the tools YAML"),
        ("- class_name: stages.tools.base.ToolResponse", r"is type, not a BaseTool subclass or a function"),
        ("- class_name: stages.tools.base.BaseTool", r"Can't instantiate abstract class|abstract"),
        ("- {class_name: stages.tools.calculator.CalculatorTool, config: {type: mcp}}",
         r"config.type 'mcp' is not supported"),
        ("- {class_name: stages.tools.calculator.CalculatorTool, schema: {}}",
         r"keys \['class_name', 'schema'\] are not valid"),
        ("- {class_name: stages.tools.calculator.CalculatorTool, config: {digits: 3}}",
         r"\(stages.tools.calculator.CalculatorTool\): calculator tool takes no config"),
        ("- {class_name: stages.tools.sandbox.PythonTool, config: {timeout: 3}}",
         (r"tools\[0\] \(stages.tools.sandbox.PythonTool\): invalid config: timeout: Extra inputs are not "
          r"permitted \(got 3\); fix the entry's `config`")),
        ("- {class_name: stages.tools.remote.RemoteTool, config: {url: 'http://h:1'}}",
         r"RemoteTool needs `tool_schema`"),
        (("- class_name: stages.tools.calculator.CalculatorTool\n"
          "  tool_schema: {function: {name: c, parameters: {properties: {x: {type: str}}}}}"),
         (r"tools\[0\] .*invalid tool_schema: function.parameters: Value error, "
          r"parameters.properties.x.type \['str'\] unknown; use one of .*; fix the entry's `tool_schema`")),
        ("- class_name: stages.tools.calculator.CalculatorTool\n- class_name: stages.tools.calculator.CalculatorTool",
         r"tools\[1\]: tool name 'calculator' is already used by .*tools\[0\]; give one of them another name"),
        ("- just a string", r"tools\[0\]: expected a mapping with class_name/config/tool_schema"),
    ],
)
def test_entry_errors_name_file_entry_and_fix(tmp_path, entry, message):
    config = write(tmp_path / "tools.yaml", "tools:\n" + textwrap.indent(entry, "  ") + "\n")
    with pytest.raises((ValueError, TypeError), match=message) as info:
        load_tools(config)
    if info.type is ValueError:
        assert str(config) in str(info.value)


def test_file_errors(tmp_path):
    with pytest.raises(ValueError, match="tools file .*nope.yaml' not found"):
        load_tools(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_tools(write(tmp_path / "bad.yaml", "tools: [\n"))
    with pytest.raises(ValueError, match="must hold a mapping with a `tools:` list of entries, got list"):
        load_tools(write(tmp_path / "list.yaml", "- class_name: x\n"))


def test_import_error_inside_a_tool_module_propagates(tmp_path):
    write(tmp_path / "broken.py", "import not_installed_dependency_xyz\n")
    config = write(tmp_path / "tools.yaml", "tools:\n  - class_name: broken.py:Tool\n")
    with pytest.raises(ModuleNotFoundError, match="not_installed_dependency_xyz"):
        load_tools(config)


def lookup(city: str, units: Literal["metric", "imperial"] = "metric", days: int = 1,
           tags: list[str] | None = None, verbose: bool = False) -> str:
    """Weather forecast for a city.

    Uses the cached forecast when there is one.

    Args:
        city: City name, e.g. "Paris".
        units (str): Unit system of
            the answer.
        days: Number of days.

    Returns:
        The forecast.
    """
    return f"{city}:{units}:{days}:{tags}:{verbose}"


def test_function_schema_from_hints_and_docstring():
    schema = function_tool(lookup).schema.to_openai()
    assert schema == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": 'City name, e.g. "Paris".'},
                    "units": {"type": "string", "enum": ["metric", "imperial"],
                              "description": "Unit system of the answer."},
                    "days": {"type": "integer", "description": "Number of days."},
                    "tags": {"type": ["array", "null"]},
                    "verbose": {"type": "boolean"},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }


def test_function_call_validates_and_coerces_integers():
    tool = function_tool(lookup)
    response = run(run_tool_call(tool, "i", ToolCall("lookup", {"city": "Oslo", "days": 3.0}), 5))
    assert response.text == "Oslo:metric:3:None:False"  # 3.0 (a JSON integer) arrives as int 3
    response = run(run_tool_call(tool, "i", ToolCall("lookup", {"city": "Oslo", "unit": "metric"}), 5))
    assert response.text.startswith("error: tool 'lookup': unexpected argument 'unit' (allowed: city, days, ")
    response = run(run_tool_call(tool, "i", ToolCall("lookup", {"city": "Oslo", "units": "kelvin"}), 5))
    assert "argument 'units' must be one of ['metric', 'imperial'], got 'kelvin'" in response.text


def test_async_function_with_rewards_and_name_override():
    async def check(answer: int) -> tuple[str, float]:
        """Check an answer."""
        await asyncio.sleep(0)
        return ("correct", 1.0) if answer == 42 else ("wrong", -0.5)

    tool = function_tool(check, name="grade", description="Grade an answer.")
    assert tool.name == "grade" and tool.schema.function.description == "Grade an answer."

    async def scenario():
        instance = await tool.create()
        responses = [await run_tool_call(tool, instance, ToolCall("grade", {"answer": a}), 5) for a in (1, 42)]
        return responses, await tool.calc_reward(instance)

    responses, reward = run(scenario())
    assert [(r.text, r.reward) for r in responses] == [("wrong", -0.5), ("correct", 1.0)]
    assert reward == 0.0  # the step rewards count once, through the loop (calc_reward adds nothing more)


def test_function_returning_a_bad_type_is_an_error_text():
    def bad(x: str) -> str:
        return 42  # type: ignore[return-value]

    response = run(run_tool_call(function_tool(bad), "i", ToolCall("bad", {"x": "a"}), 5))
    assert response.text == "error: tool 'bad' failed: TypeError: function tool 'bad' returned int; return str or " \
                            "(str, reward)"

    def full() -> ToolResponse:
        return ToolResponse("r", 2.0, {"k": 1.0})

    response = run(run_tool_call(function_tool(full), "i", ToolCall("full", {}), 5))
    assert (response.text, response.reward, response.metrics["k"]) == ("r", 2.0, 1.0)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda *args: "", r"parameter 'args' is variadic positional; tools are called with keyword arguments"),
        (lambda **kwargs: "", r"parameter 'kwargs' is variadic keyword"),
    ],
)
def test_function_signature_errors(fn, message):
    with pytest.raises(ValueError, match=message):
        function_tool(fn, name="f")


def test_unsupported_hint_names_the_parameter():
    def f(path: Path) -> str:
        return ""

    with pytest.raises(ValueError, match=r"parameter 'path': type hint .*Path.* has no JSON type"):
        function_tool(f)


def test_parse_docstring():
    summary, args = parse_docstring("""Two lines
    of summary.

    Args:
        a: First.
        b (int, optional): Second,
            continued.
        *rest: Ignored star.

    Returns:
        a: not an argument.
    """)
    assert summary == "Two lines of summary."
    assert args == {"a": "First.", "b": "Second, continued.", "rest": "Ignored star."}
    assert parse_docstring("") == ("", {})


def test_base_tool_without_default_schema():
    class NoSchema(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse("")

    with pytest.raises(ValueError, match="NoSchema has no default schema; give `tool_schema`"):
        NoSchema()


def test_an_unknown_tool_call_format_fails_when_the_tools_load(tmp_path):
    """It failed at the first model turn, after a batch's generation; a parser a tool module registers counts."""
    from infra.rl_config import MultiTurnConfig
    from stages.agent.rollout import load_rollout_tools
    from stages.tools.parsers import TOOL_PARSERS

    tools = write(tmp_path / "my_tools.py", """
        from stages.tools.parsers import TOOL_PARSERS, register_parser

        def shout(text: str) -> str:
            '''Shout.'''
            return text.upper()

        if "mine" not in TOOL_PARSERS:
            register_parser("mine")(lambda text: [])
        """)
    functions = [f"{tools}:shout"]
    with pytest.raises(ValueError, match=r"rl\.multi_turn\.format='hermse' names no tool-call parser; valid: .*hermes"):
        load_rollout_tools(MultiTurnConfig(tool_functions=functions, format="hermse"))
    try:
        assert list(load_rollout_tools(MultiTurnConfig(tool_functions=functions, format="mine"))) == ["shout"]
    finally:
        TOOL_PARSERS.pop("mine", None)
    assert load_rollout_tools(MultiTurnConfig(format="hermse")) == {}  # no tools: the format is not used
