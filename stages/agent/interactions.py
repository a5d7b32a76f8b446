"""Simulated users ("interactions", verl's `multi_turn.interaction_config_path`): after a model turn without a tool
call, the sample's interaction reads the conversation and answers as the user, scores the turn, and may end the
conversation. The `tool_agent` loop (stages/agent/tool_loop.py) runs them.

verl's interface (`verl/interactions/base.py`), per trajectory, one object serving every trajectory by instance id:

    start_interaction(instance_id=None, **interaction_kwargs) -> instance id
    generate_response(instance_id, messages, **interaction_kwargs)
        -> (should_terminate_sequence, response_content, current_turn_score, additional_data)
    calculate_score(instance_id, **kwargs) -> float        (the interaction's own helper; the loop never calls it)
    finalize_interaction(instance_id, **kwargs)             (always, when start_interaction succeeded)

verl's YAML (`rl.multi_turn.interaction_config_path`):

    interaction:
      - name: gsm8k                                        # optional: default from the class name (Gsm8kInteraction
        class_name: stages.agent.interactions.Gsm8kInteraction   # -> gsm8k), as verl; or path/to/file.py:Class
        config: {method: strict}                           # the class's own settings (relative to the YAML)

Each row picks its interaction with `extra_info.interaction_kwargs.name`; the whole `interaction_kwargs` (e.g.
`ground_truth`) is passed to `start_interaction` and `generate_response`, as in verl.

Deviations from verl:

- An interaction that raises, times out (`rl.multi_turn.interaction_timeout_s`) or returns something other than the
  4-tuple ends its trajectory (`finish_reason` "interaction_error", `interaction/errors`), never the run
  (`InteractionSession`); verl's loop lets the exception through.
- The loop calls `finalize_interaction` at the end of every trajectory whose `start_interaction` succeeded (verl's
  agent loop never calls it, so its Gsm8kInteraction keeps every instance).
- The turn scores add to the outcome score (`interaction_reward_weight`); verl only passes them on as `turn_scores`.
- The model turn that reaches a turn limit is judged too, and a reply that ends the conversation is recorded but
  not appended (stages/agent/tool_loop.py says why).
- `Interaction` is abstract in `generate_response` (verl's base returns a canned reply).
- `interaction_kwargs` keys whose value is None are not passed (`pick_interaction`): in a parquet file they are the
  keys of other rows.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import yaml

from infra.imports import load_object
from stages.rewards.gsm8k import compute_score as gsm8k_score

logger = logging.getLogger(__name__)

ENTRY_KEYS = ("name", "class_name", "config")


class Interaction(ABC):
    """A simulated user with verl's lifecycle. `config` is the entry's `config:` plus its `name` (as verl injects it).

    Args:
        config: The interaction's settings from the YAML (subclasses validate them with their own pydantic model).
    """

    def __init__(self, config: dict[str, Any] | None = None):
        self.config = dict(config or {})
        self.name: str = self.config.get("name", type(self).__name__)

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start one trajectory's conversation; -> its instance id (a new uuid4 when None is given). The loop
        passes its own id and keeps using it, as verl's does."""
        return instance_id or uuid.uuid4().hex

    @abstractmethod
    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        """The user's reply to the conversation so far (`messages`: prompt, assistant, tool and user chat dicts):
        (should_terminate_sequence, response_content, current_turn_score, additional_data)."""

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """A score of the conversation so far, for the interaction's own use (e.g. inside generate_response)."""
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Release the instance's state."""


class Gsm8kConfig(pydantic.BaseModel):
    """Settings of `Gsm8kInteraction`."""

    model_config = pydantic.ConfigDict(extra="forbid")

    method: str = pydantic.Field("strict", pattern="^(strict|flexible)$",
                                 description="strict: the number after the last `#### `; flexible: the last number.")
    correct_text: str = pydantic.Field("Your answer is correct.", description="The reply to a right answer.")
    wrong_text: str = pydantic.Field(
        "Your answer is wrong. Check your work and try again; end with the final answer as `#### N`.",
        description="The reply to a wrong or missing answer.")


class Gsm8kInteraction(Interaction):
    """Checks the model's last answer against `interaction_kwargs.ground_truth` with GSM8K's scorer
    (stages/rewards/gsm8k.py, so `#### N` answers of the gsm8k, arithmetic and calculator tasks): a right answer
    ends the conversation with turn score 1, a wrong or missing one gets `wrong_text` and score 0 (verl's
    Gsm8kInteraction semantics)."""

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        self.settings = Gsm8kConfig.model_validate({k: v for k, v in self.config.items() if k != "name"})
        self.instances: dict[str, dict[str, str]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: Any = None,
                                **kwargs: Any) -> str:
        if ground_truth is None:
            raise ValueError("interaction_kwargs has no ground_truth; give each row "
                             "extra_info.interaction_kwargs.ground_truth")
        instance_id = await super().start_interaction(instance_id)
        self.instances[instance_id] = {"ground_truth": str(ground_truth), "response": ""}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        last = next((m for m in reversed(messages) if m.get("role") == "assistant"), {})
        self.instances[instance_id]["response"] = str(last.get("content") or "")
        score = await self.calculate_score(instance_id)
        text = self.settings.correct_text if score == 1.0 else self.settings.wrong_text
        return score == 1.0, text, score, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        state = self.instances[instance_id]
        return gsm8k_score(state["response"], state["ground_truth"], method=self.settings.method)

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self.instances.pop(instance_id, None)


def load_interactions(path: str | Path) -> dict[str, Interaction]:
    """Interactions by name from a YAML file in verl's format (module docstring).

    Raises:
        ValueError: The file is missing or not YAML, an entry is malformed, a class cannot be found, is not an
            Interaction or rejects its config, or two entries share a name.
    """
    path = Path(path)
    interactions: dict[str, Interaction] = {}
    where_of: dict[str, str] = {}
    for index, entry in enumerate(_read_yaml(path)):
        where = f"{path}: interaction[{index}]"
        name, interaction = _build(entry, where, path.resolve().parent)
        if name in interactions:
            raise ValueError(f"{where}: name {name!r} is already used by {where_of[name]}; give one of them "
                             "another `name` (rows choose by extra_info.interaction_kwargs.name)")
        interactions[name], where_of[name] = interaction, where
    return interactions


def _read_yaml(path: Path) -> list[Any]:
    if not path.is_file():
        raise ValueError(f"interaction file {str(path)!r} not found; give rl.multi_turn.interaction_config_path "
                         "the path of a YAML file with an `interaction:` list")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"interaction file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("interaction"), list) or not data["interaction"]:
        raise ValueError(f"interaction file {str(path)!r} must hold a mapping with a non-empty `interaction:` list "
                         f"of entries (name, class_name, config), got {_short(data)}")
    return data["interaction"]


def _build(entry: Any, where: str, base_dir: Path) -> tuple[str, Interaction]:
    """(name, interaction) of one YAML entry."""
    if not isinstance(entry, dict):
        raise ValueError(  # noqa: TRY004 - bad user input is a ValueError here (STYLE.md)
            f"{where}: expected a mapping with name/class_name/config, got {_short(entry)}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; an entry has `class_name` (required), `name` and `config`")
    spec = entry.get("class_name")
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{where}: `class_name` is missing or not a string (got {_short(spec)}); give the class as "
                         "package.module.Class or path/to/file.py:Class")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ValueError(f"{where}: `config` must be a mapping, got {_short(config)}")  # noqa: TRY004
    name = entry.get("name", _default_name(spec))
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: `name` must be a non-empty string, got {_short(name)}")
    cls = load_object(_relative_to(spec, base_dir), f"{where}: class_name")
    if not (inspect.isclass(cls) and issubclass(cls, Interaction)) or inspect.isabstract(cls):
        raise ValueError(f"{where}: class_name {spec!r} is not a concrete subclass of "
                         "stages.agent.interactions.Interaction; subclass it and implement generate_response")
    try:
        return name, cls(config={**config, "name": name})
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']} (got {_short(e['input'])})"
                             for e in exc.errors())
        raise ValueError(f"{where} ({spec}): invalid config: {problems}; fix the entry's `config`") from None
    except ValueError as exc:
        raise ValueError(f"{where} ({spec}): {exc}") from exc


def _default_name(spec: str) -> str:
    """verl's default name: the class name without an `Interaction` suffix, lower case (Gsm8kInteraction -> gsm8k)."""
    simple = spec.rpartition(":")[2].rpartition(".")[2]
    stem = simple[: -len("Interaction")] if simple.endswith("Interaction") else simple
    return (stem or simple).lower()


def _relative_to(spec: str, base_dir: Path) -> str:
    """`file.py:Class` with a relative file made relative to the YAML's folder; dotted paths unchanged."""
    if ":" not in spec:
        return spec
    file_part, _, attr = spec.rpartition(":")
    path = Path(file_part).expanduser()
    return f"{path if path.is_absolute() else base_dir / path}:{attr}"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def pick_interaction(interactions: dict[str, Interaction], extra_info: dict | None) -> tuple[Interaction, dict] | None:
    """The row's interaction and its kwargs (`extra_info.interaction_kwargs` without its None values), or None for a
    row without them. A parquet struct column has the keys of every row, so a key that only other rows have reads
    back as None: dropping those lets the interaction's own defaults apply (verl passes the None through).

    Raises:
        ValueError: The kwargs have no `name`, or name an interaction that is not configured.
    """
    kwargs = (extra_info or {}).get("interaction_kwargs")
    if not kwargs or not interactions:
        return None
    row = f"row index={(extra_info or {}).get('index')}"
    if not isinstance(kwargs, dict) or not kwargs.get("name"):
        raise ValueError(f"{row}: extra_info.interaction_kwargs {_short(kwargs)} has no `name`; set it to one of "
                         f"the configured interactions {sorted(interactions)}")
    if kwargs["name"] not in interactions:
        raise ValueError(f"{row}: extra_info.interaction_kwargs.name={kwargs['name']!r} is not configured in "
                         f"rl.multi_turn.interaction_config_path; configured: {sorted(interactions)}")
    return interactions[kwargs["name"]], {k: v for k, v in kwargs.items() if v is not None}


@dataclass
class Reply:
    """One user turn, as the interaction gave it."""

    terminate: bool  # should_terminate_sequence
    text: str  # response_content
    score: float  # current_turn_score (None counts as 0.0)
    data: dict = field(default_factory=dict)  # additional_data


class InteractionSession:
    """One trajectory's conversation with its interaction, under a timeout per call.

    A call that raises, times out or returns something other than verl's 4-tuple is counted
    (`interaction/errors`, `interaction/timeouts`) and logged, with its traceback the first time per interaction
    and method (`warned`, shared by a loop's sessions); the session is then `failed` and the loop ends the
    trajectory: a broken interaction costs its trajectories, never the run. A synchronous interaction that blocks
    the event loop cannot be timed out.
    """

    def __init__(self, interaction: Interaction, kwargs: dict, timeout_s: float, metrics: dict[str, float],
                 warned: set[tuple[str, str]]):
        self.interaction, self.kwargs, self.timeout_s = interaction, kwargs, timeout_s
        self.metrics, self.warned = metrics, warned
        self.instance_id = uuid.uuid4().hex
        self.started = self.failed = False
        for key in ("turns", "terminations", "errors", "timeouts"):
            self.metrics.setdefault(f"interaction/{key}", 0.0)

    async def start(self) -> None:
        self.started = await self._call("start_interaction", self.instance_id, **self.kwargs) is not _FAILED

    async def respond(self, messages: list[dict]) -> Reply | None:
        """The user's reply to `messages`; None when the interaction failed (now or earlier)."""
        if self.failed or not self.started:
            return None
        result = await self._call("generate_response", self.instance_id, list(messages), **self.kwargs)
        if result is _FAILED:
            return None
        reply = _as_reply(result)
        if isinstance(reply, str):
            self._fail("generate_response", TypeError(reply))
            return None
        self.metrics["interaction/turns"] += 1
        self.metrics["interaction/terminations"] += float(reply.terminate)
        return reply

    async def finalize(self) -> None:
        if self.started:
            await self._call("finalize_interaction", self.instance_id, **self.kwargs)

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.wait_for(getattr(self.interaction, method)(*args, **kwargs), self.timeout_s)
        except TimeoutError as exc:
            self.metrics["interaction/timeouts"] += 1
            self._fail(method, exc)
        except Exception as exc:  # any failure of an interaction ends its trajectory, by contract (docstring)
            self._fail(method, exc)
        return _FAILED

    def _fail(self, method: str, exc: BaseException) -> None:
        self.failed = True
        self.metrics["interaction/errors"] += 1
        key = (self.interaction.name, method)
        what = f"timed out after {self.timeout_s} s" if isinstance(exc, TimeoutError) else f"raised {exc!r}"
        logger.warning("interaction %r: %s %s; its trajectory ends (finish_reason interaction_error)",
                       self.interaction.name, method, what, exc_info=key not in self.warned)
        self.warned.add(key)


_FAILED = object()  # what a failed call returns


def _as_reply(result: Any) -> Reply | str:
    """verl's 4-tuple as a Reply, or a text saying what is wrong with it."""
    if not isinstance(result, (tuple, list)) or len(result) != 4:
        return (f"generate_response must return (should_terminate_sequence, response_content, current_turn_score, "
                f"additional_data), got {_short(result)}")
    terminate, text, score, data = result
    if not isinstance(text, str):
        return f"generate_response's response_content must be a str, got {_short(text)}"
    try:
        score = 0.0 if score is None else float(score)
    except (TypeError, ValueError):
        return f"generate_response's current_turn_score must be a number, got {_short(score)}"
    if not math.isfinite(score):
        return f"generate_response's current_turn_score must be finite, got {score}"
    if data is not None and not isinstance(data, dict):
        return f"generate_response's additional_data must be a dict, got {_short(data)}"
    return Reply(bool(terminate), text, score, dict(data or {}))
