"""A user's local parquet/JSONL rows, mapped to the pipeline's `Example`s by `data.columns`.

This module also holds what every recipe shares: `Example` (one problem before it is written in verl's
schema), `Splits`, reading local files (data/reading.py: with row locations for error messages), the bad-row policy
(`data.bad_rows`: error or skip and count) and the seeded train/validation split.

A file (or a folder of files) is read in one of two layouts, detected from its columns:

- mapped: `data.columns` names the question column (plain text, or already a verl chat list), the answer
  column (a bare ground truth, or a full answer whose ground truth follows the last `####`), an optional
  SFT response column (default: the answer) and an optional data_source column (default:
  `data.data_source`);
- verl: columns `prompt` (chat list) and `reward_model` (`{"ground_truth": ...}`), optionally
  `data_source`, `ability`, `extra_info`, `agent_name`; rows are passed through after the same validation.

A folder where some file names hold the word test/validation/valid/val/dev/eval keeps that split (those
files are the validation split, all others the training split); any other file or folder is split by
`data.validation_fraction` with the run's seed.

`with_interaction` attaches a simulated user to any recipe's rows (`data.interaction`), as verl's
`examples/data_preprocess/gsm8k_multiturn_w_interaction.py` does for GSM8K.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from data.reading import BadRow, Row, column_names, data_files, read_rows, split_files
from infra.config_sections import ColumnMapping, DataConfig

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
VERL_COLUMNS = ("prompt", "reward_model")
EXTRA_INFO_KEYS = ("split", "index", "question", "answer")  # written by data_prep; others pass through
NUMBER = re.compile(r"-?[0-9][0-9,]*(\.[0-9]+)?")
TOOL_LOOP = "tool_agent"  # the agent loop (stages/agent/tool_loop.py) that runs tools and simulated users


@dataclass(frozen=True)
class Example:
    """One problem, before it is written in verl's schema."""

    prompt: list[dict[str, str]]  # chat list: [{"role": "user", "content": ...}]
    ground_truth: str
    response: str  # SFT target
    question: str  # the question text (the last user turn for chat-list input)
    answer: str  # the full reference answer
    data_source: str
    ability: str
    index: int  # row index in its source (file, hub split or generator)
    extra: dict[str, Any] = field(default_factory=dict)  # other extra_info keys of verl-schema input
    agent_name: str | None = None  # the RL row's agent loop (stages/agent); None: single_turn
    sft_turns: list[dict[str, str]] | None = None  # multi-turn SFT target: assistant/tool messages after the prompt


@dataclass
class Splits:
    train: list[Example]
    validation: list[Example]
    num_skipped_rows: int = 0
    sft_extra: list[Example] = field(default_factory=list)  # SFT-only rows about `train` problems


Convert = Callable[[dict, int], Example]


# --------------------------------------------------------------------------------------------------
# Bad rows and splitting


def convert_rows(rows: Iterable[Row], convert: Convert, bad_rows: str) -> tuple[list[Example], int]:
    """Apply `convert` to every row; a BadRow raises ValueError (bad_rows=error) or is counted (skip)."""
    examples, skipped, first = [], 0, None
    for where, row in rows:
        try:
            if isinstance(row, BadRow):
                raise row
            examples.append(convert(row, where.index))
        except BadRow as exc:
            if bad_rows == "error":
                raise ValueError(f"{where}: {exc}; fix the row or set data.bad_rows=skip") from None
            skipped += 1
            first = first or f"{where}: {exc}"
    if skipped:
        logger.warning("skipped %d bad rows (data.bad_rows=skip); the first: %s", skipped, first)
    return examples, skipped


def split_by_fraction(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Hold out round(fraction * n) examples (at least 1) chosen by `seed`; both keep the source order."""
    n = len(examples)
    if n < 2:
        raise ValueError(f"only {n} valid rows: data.validation_fraction needs at least 2 to split")
    num_validation = min(n - 1, max(1, round(fraction * n)))
    held_out = set(random.Random(seed).sample(range(n), num_validation))
    train = [e for i, e in enumerate(examples) if i not in held_out]
    validation = [e for i, e in enumerate(examples) if i in held_out]
    return train, validation


def load_local(path: Path, convert: Convert, cfg: DataConfig, seed: int) -> Splits:
    """Read a local file or folder, convert every row, split by file names or by validation_fraction."""
    groups = split_files(data_files(path))
    converted, skipped = {}, 0
    for name, files in groups.items():
        rows = (row for p in files for row in read_rows(p))
        converted[name], n = convert_rows(rows, convert, cfg.bad_rows)
        skipped += n
    if "all" in converted:
        train, validation = split_by_fraction(converted["all"], cfg.validation_fraction, seed)
    else:
        train, validation = converted["train"], converted["validation"]
    return Splits(train, validation, skipped)


def with_interaction(examples: list[Example], name: str | None) -> list[Example]:
    """The rows with the simulated user `name` (`data.interaction`; None: unchanged), as verl's GSM8K interaction
    preprocessing writes them: `extra_info.interaction_kwargs = {name, query, ground_truth}` (query: the last user
    message of the prompt, instruction included), which the interaction reads (Gsm8kInteraction checks the model's
    `#### N` against ground_truth), and agent_name `tool_agent`, the loop that runs interactions. A row that names
    a loop of its own (a user's AgentLoop) keeps it, and a row that already has interaction_kwargs (verl-format
    input) keeps them."""
    if name is None:
        return examples
    out = []
    for e in examples:
        agent_name = e.agent_name if e.agent_name not in (None, "single_turn") else TOOL_LOOP
        extra = e.extra
        if not extra.get("interaction_kwargs"):
            kwargs = {"name": name, "query": last_user_content(e.prompt), "ground_truth": e.ground_truth}
            extra = {**extra, "interaction_kwargs": kwargs}
        out.append(replace(e, agent_name=agent_name, extra=extra))
    return out


# --------------------------------------------------------------------------------------------------
# Fields


def text_field(row: dict, key: str, label: str, numbers: bool = False) -> str:
    """The text at `key`; with `numbers`, a whole number (an int column, or a float like 42.0) as its text too."""
    value = row.get(key)
    if value is None:
        raise BadRow(f"{label} is missing")
    if numbers and isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer():
        return str(int(value))
    if not isinstance(value, str):
        raise BadRow(f"{label} is {type(value).__name__} {_short(value)}, expected text")
    if not value.strip():
        raise BadRow(f"{label} is empty")
    return value


def chat_field(value: Any, label: str) -> list[dict[str, str]]:
    """A verl chat list: [{"role": "system"|"user"|"assistant", "content": str}, ...] with a user turn."""
    if not isinstance(value, list):
        raise BadRow(f"{label} is {type(value).__name__} {_short(value)}, expected a chat list")
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)):
            raise BadRow(f"{label}[{i}] is {_short(message)}; expected {{'role': one of {ROLES}, 'content': text}}")
    if not any(m["role"] == "user" and m["content"].strip() for m in value):
        raise BadRow(f"{label} has no non-empty user message")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def last_user_content(prompt: list[dict[str, str]]) -> str:
    return next(m["content"] for m in reversed(prompt) if m["role"] == "user")


def ground_truth_of(answer: str, label: str) -> str:
    """A bare ground truth, or from a full answer the text after its last '####'; commas out of a number either
    way (the scorers strip them from the model's answer: '1,000' could never be matched)."""
    truth = answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()
    if not truth and "####" in answer:
        raise BadRow(f"{label} has nothing after '####'")
    return truth.replace(",", "") if NUMBER.fullmatch(truth) else truth


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------------------------------
# Row layouts


def mapped_example(row: dict, index: int, columns: ColumnMapping, default_data_source: str) -> Example:
    """A row of a mapped file (see the module docstring)."""

    def label(name: str) -> str:
        return f"field {getattr(columns, name)!r} (mapped by data.columns.{name})"

    question = row.get(columns.question)
    if isinstance(question, list):
        prompt = chat_field(question, label("question"))
        question = last_user_content(prompt)
    else:
        question = text_field(row, columns.question, label("question"))
        prompt = [{"role": "user", "content": question}]
    answer = text_field(row, columns.answer, label("answer"), numbers=True)  # an int column of final answers
    response = text_field(row, columns.response, label("response")) if columns.response else answer
    data_source = (text_field(row, columns.data_source, label("data_source"))
                   if columns.data_source and row.get(columns.data_source) is not None else None)  # None: the default
    return Example(
        prompt=prompt,
        ground_truth=ground_truth_of(answer, label("answer")),
        response=response,
        question=question,
        answer=answer,
        data_source=data_source or default_data_source,
        ability="custom",
        index=index,
    )


def verl_example(row: dict, index: int, columns: ColumnMapping, default_data_source: str) -> Example:
    """A row already in verl's schema; extra_info keys other than split/index/question/answer pass through."""
    prompt = chat_field(row.get("prompt"), "field 'prompt'")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict):
        raise BadRow(f"field 'reward_model' is {_short(reward_model)}, expected {{'ground_truth': text}}")
    ground_truth = text_field(reward_model, "ground_truth", "field 'reward_model.ground_truth'")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise BadRow(f"field 'extra_info' is {_short(extra)}, expected a struct/object")
    data_source = (text_field(row, "data_source", "field 'data_source'")
                   if row.get("data_source") is not None else None)  # a null (a parquet's missing value): the default
    answer = extra.get("answer") if isinstance(extra.get("answer"), str) else ground_truth
    response = text_field(row, columns.response, f"field {columns.response!r}") if columns.response else answer
    question = extra.get("question")
    agent_name = text_field(row, "agent_name", "field 'agent_name'") if row.get("agent_name") is not None else None
    return Example(
        prompt=prompt,
        ground_truth=ground_truth,
        response=response,
        question=question if isinstance(question, str) else last_user_content(prompt),
        answer=answer,
        data_source=data_source or default_data_source,
        ability=row["ability"] if isinstance(row.get("ability"), str) else "custom",
        index=extra["index"] if isinstance(extra.get("index"), int) else index,
        extra={k: v for k, v in extra.items() if k not in EXTRA_INFO_KEYS},
        agent_name=agent_name,
    )


def load_files(cfg: DataConfig, seed: int) -> Splits:
    """source=file: the file or folder at `data.path`, mapped by `data.columns` or in verl's schema."""
    path = Path(cfg.path).expanduser() if cfg.path else None
    layout = verl_example if check_columns(cfg) else mapped_example
    logger.info("reading %s as %s rows", cfg.path, "verl-schema" if layout is verl_example else "mapped")

    def convert(row: dict, index: int) -> Example:
        return layout(row, index, cfg.columns, cfg.data_source)

    return load_local(path, convert, cfg, seed)


def check_columns(cfg: DataConfig) -> bool:
    """source=file: whether `data.path` holds verl-schema rows (else mapped ones); a ValueError naming the field and
    the fix when it is missing or its columns fit neither layout. Reads the files' columns only (the command line
    checks this before the flow starts)."""
    if cfg.path is None:
        raise ValueError("data.source=file needs data.path: a local .parquet/.jsonl file or a folder of them")
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise ValueError(f"data.path={cfg.path!r} does not exist; point it at a local .parquet/.jsonl or a folder")
    names = column_names(data_files(path))
    if all(c in names for c in VERL_COLUMNS):
        return True
    problem = verl_layout_problem(names, cfg.path, cfg.columns)
    if problem:
        raise ValueError(problem)
    _check_mapping(cfg.columns, names, cfg.path)
    return False


def verl_layout_problem(names: set[str], where: str, columns: ColumnMapping) -> str | None:
    """Why rows with verl's `prompt` column but no `reward_model` cannot be read, or None (they are not such rows,
    or `data.columns` maps them). verl's RL rows carry their ground truth in `reward_model` ({'ground_truth': ...}),
    which the reward functions read; without it the rows read as mapped ones, whose default columns they lack."""
    mapped = all(c in names for c in columns.model_dump().values() if c is not None)
    if "prompt" not in names or "reward_model" in names or mapped:
        return None
    return (f"{where}: a 'prompt' column (verl's) but no 'reward_model' column (columns: {sorted(names)}); verl's "
            "RL rows give their ground truth as reward_model = {'ground_truth': ...}, as verl's "
            "examples/data_preprocess scripts write it. Add that column, or map your columns (overrides of this "
            "project, before any --verl): data.columns.question=prompt data.columns.answer=<the column that holds "
            "the answer>")


def _check_mapping(columns: ColumnMapping, names: set[str], path: str) -> None:
    """A mapped column absent from every row is a configuration error, not a bad row."""
    for name, column in columns.model_dump().items():
        if column is not None and column not in names:
            raise ValueError(
                f"data.columns.{name}={column!r} is not a column of {path} (columns: {sorted(names)}); "
                f"set data.columns.{name}=<one of those>"
            )
