"""Data prep stage: a recipe's examples -> verl-schema RL parquet + SFT parquet; and the shared prompt loader.

`run_data_prep` writes into `out_dir`:

- `train.parquet`, `validation.parquet` (verl's RL schema, `RL_SCHEMA`): `data_source` string,
  `prompt` list<struct<role: string, content: string>>, `ability` string,
  `reward_model` struct<style: string ("rule"), ground_truth: string>,
  `extra_info` struct<split: string, index: int64, question: string, answer: string, ...>;
- an `agent_name` string column (verl's: the row's agent loop, stages/agent) when a recipe sets one; its tools'
  per-row arguments go in `extra_info.tools_kwargs` (`{tool: {"create_kwargs": {...}}}`);
- with `data.interaction` (a simulated user's name, any source), every RL row of both splits on `tool_agent` with
  `extra_info.interaction_kwargs = {name, query, ground_truth}` (verl's gsm8k interaction preprocessing;
  `data.files.with_interaction`); the SFT splits are unchanged;
- `sft_train.parquet`, `sft_validation.parquet`: `prompt` (same chat list) and `response` string (the
  train split's rows plus any SFT-only rows of the recipe, e.g. the synthetic task's shortcut answers), and
  when a recipe has multi-turn targets a `turns` chat list (the assistant and tool messages after the prompt;
  empty for single-turn rows);
- `stats.json`, also returned.

Every row is validated and every table built before the first file is written, so a bad row leaves no
half-written dataset.

`load_prompts` reads an RL parquet for SFT/RL/evaluation with verl's `RLHFDataset` semantics: the chat
template is applied with `add_generation_prompt=True`; prompts over `data.max_prompt_length` tokens are
dropped when `data.filter_overlong_prompts`, else handled by `data.truncation` (error, left: keep the last
tokens, right: keep the first).
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from data.files import Example, Splits, load_files, with_interaction
from data.gsm8k import load_gsm8k
from data.synthetic import load_synthetic
from infra.config_sections import DataConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

RECIPES: dict[str, Callable[[DataConfig, int], Splits]] = {
    "synthetic": load_synthetic,
    "gsm8k": load_gsm8k,
    "file": load_files,
}
ROLE_NAMES = ["system", "user", "assistant"]
CHAT = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
REWARD_MODEL = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
EXTRA_INFO_FIELDS = [("split", pa.string()), ("index", pa.int64()), ("question", pa.string()), ("answer", pa.string())]
RL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", CHAT),
        ("ability", pa.string()),
        ("reward_model", REWARD_MODEL),
        ("extra_info", pa.struct(EXTRA_INFO_FIELDS)),
    ]
)
SFT_SCHEMA = pa.schema([("prompt", CHAT), ("response", pa.string())])
REQUIRED_COLUMNS = ("prompt", "data_source", "reward_model")


# --------------------------------------------------------------------------------------------------
# The stage


def _warn_bare_sft_targets(train: list) -> None:
    """SFT's target is the row's response (data.columns.response), else its answer (extra_info.answer in verl's
    rows), else the bare ground truth: verl's MATH and DAPO files carry no answer, so SFT taught `1/2` where the
    reward wants `\\boxed{\\frac{1}{2}}`, and RL started from a model its reward scores 0. Said when most targets are
    bare."""
    bare = sum(str(e.response).strip() == str(e.ground_truth).strip() for e in train)
    if train and bare > len(train) / 2:
        logger.warning(
            "data prep: %d of %d SFT targets are the bare ground truth (the rows have no response column and no "
            "extra_info.answer): SFT would teach answers without the worked steps or the format the reward checks "
            "(\\boxed{}, ####). Set data.columns.response to a column of full solutions, or sft.enabled=false",
            bare, len(train))


def _warn_validation_in_train(train: list, validation: list) -> None:
    """Held-out rows whose prompt is also a training prompt (a file with duplicate rows split at random) measure
    memorisation, not generalisation: counted and said."""
    seen = {json.dumps(e.prompt, sort_keys=True) for e in train}
    shared = sum(json.dumps(e.prompt, sort_keys=True) in seen for e in validation)
    if shared:
        logger.warning("data prep: %d of %d validation prompts are also training prompts (duplicate rows in the "
                       "data?): held-out accuracy on them is not held out. Remove the duplicates, or split the "
                       "files by name (train/test)", shared, len(validation))


def run_data_prep(cfg: DataConfig, seed: int, out_dir: Path) -> dict:
    """Build the dataset of `cfg.source` and write the RL and SFT splits plus stats.json to `out_dir`."""
    splits = RECIPES[cfg.source](cfg, seed)
    train, train_dropped = _cap(splits.train, cfg.max_train_samples, "data.max_train_samples", seed)
    validation, validation_dropped = _cap(splits.validation, cfg.max_validation_samples, "data.max_validation_samples",
                                          seed)
    for name, rows in (("train", train), ("validation", validation)):
        if not rows:
            raise ValueError(f"data.source={cfg.source}: the {name} split is empty; check the input or its bad rows")
    _warn_bare_sft_targets(train)
    _warn_validation_in_train(train, validation)
    rl_train, rl_validation = with_interaction(train, cfg.interaction), with_interaction(validation, cfg.interaction)
    schema = rl_schema(rl_train + rl_validation)
    tables = {
        "train.parquet": rl_table(rl_train, "train", schema),
        "validation.parquet": rl_table(rl_validation, "validation", schema),
        "sft_train.parquet": sft_table(train + _about(splits.sft_extra, train)),
        "sft_validation.parquet": sft_table(validation),
    }
    stats = {
        "source": cfg.source,
        "num_train": len(train),
        "num_sft_extra": len(tables["sft_train.parquet"]) - len(train),
        "num_validation": len(validation),
        "num_skipped_rows": splits.num_skipped_rows,
        "num_train_dropped_by_cap": train_dropped,
        "num_validation_dropped_by_cap": validation_dropped,
        "data_sources": dict(Counter(e.data_source for e in train + validation)),
        "interaction": cfg.interaction,
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():
        pq.write_table(table, out_dir / name)
    (out_dir / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    logger.info("data prep (%s): %d train, %d validation rows -> %s", cfg.source, len(train), len(validation), out_dir)
    return stats


def _about(extra: list[Example], train: list[Example]) -> list[Example]:
    """The SFT-only rows whose problem is still in the (capped) train split."""
    kept = {e.index for e in train}
    return [e for e in extra if e.index in kept]


def _cap(examples: list[Example], cap: int | None, key: str, seed: int) -> tuple[list[Example], int]:
    """`cap` rows drawn at random (seeded; kept in their order), as verl's train_max_samples / val_max_samples with
    its default shuffle: the first rows of a file sorted by source would all be one source."""
    if cap is None or len(examples) <= cap:
        return examples, 0
    kept = sorted(random.Random(f"{key}-{seed}").sample(range(len(examples)), cap))
    logger.info("%s=%d: keeping %d of %d rows, drawn at random (run.seed)", key, cap, cap, len(examples))
    return [examples[i] for i in kept], len(examples) - cap


def rl_schema(examples: list[Example]) -> pa.Schema:
    """RL_SCHEMA, with extra_info extended by the keys that verl-schema input passes through (types inferred)."""
    schema = RL_SCHEMA
    if any(e.agent_name for e in examples):
        schema = schema.append(pa.field("agent_name", pa.string()))
    extras = [_parquet_extra(e.extra) for e in examples]
    if not any(extras):
        return schema
    try:
        inferred = pa.array(extras).type
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ValueError(f"extra_info of the input has keys whose types differ between rows: {exc}") from None
    extra_info = pa.struct(EXTRA_INFO_FIELDS + [inferred.field(i) for i in range(inferred.num_fields)])
    return schema.set(schema.get_field_index("extra_info"), pa.field("extra_info", extra_info))


def _parquet_extra(extra: dict) -> dict:
    """extra_info as Parquet can hold it: an empty mapping inside (`create_kwargs: {}`, a tool without per-row
    arguments) is a struct without fields, which Parquet cannot write; it becomes None, which the readers take for
    {} (stages/agent/tool_loop.py `_create_kwargs`)."""
    return {key: _no_empty_mappings(value) for key, value in extra.items()}


def _no_empty_mappings(value):
    if isinstance(value, dict):
        value = {key: _no_empty_mappings(item) for key, item in value.items()}
        return value or None
    if isinstance(value, list):
        return [_no_empty_mappings(item) for item in value]
    return value


def rl_table(examples: list[Example], split: str, schema: pa.Schema) -> pa.Table:
    rows = [
        {
            "data_source": e.data_source,
            "prompt": e.prompt,
            "ability": e.ability,
            "reward_model": {"style": "rule", "ground_truth": e.ground_truth},
            "extra_info": {**_parquet_extra(e.extra), "split": split, "index": e.index, "question": e.question,
                           "answer": e.answer},
            "agent_name": e.agent_name,
        }
        for e in examples
    ]
    return pa.Table.from_pylist(rows, schema=schema)


def sft_table(examples: list[Example]) -> pa.Table:
    """prompt, response; `turns` when a row is a conversation with tools; `agent_name` when a row names its loop (SFT
    renders the tools into tool_agent rows' prompts, as RL does)."""
    schema, rows = SFT_SCHEMA, [{"prompt": e.prompt, "response": e.response} for e in examples]
    if any(e.sft_turns for e in examples):
        schema = schema.append(pa.field("turns", CHAT))
        for row, e in zip(rows, examples):
            row["turns"] = e.sft_turns or []
    if any(e.agent_name for e in examples):
        schema = schema.append(pa.field("agent_name", pa.string()))
        for row, e in zip(rows, examples):
            row["agent_name"] = e.agent_name
    return pa.Table.from_pylist(rows, schema=schema)


def corpus_texts(out_dir: Path) -> list[str]:
    """Prompt contents and responses of the written train split, plus the role names (tokenizer training)."""
    out_dir = Path(out_dir)
    texts = [m["content"] for chat in pq.read_table(out_dir / "train.parquet")["prompt"].to_pylist() for m in chat]
    sft = pq.read_table(out_dir / "sft_train.parquet").to_pydict()
    texts += [m["content"] for chat in sft["prompt"] + sft.get("turns", []) for m in chat] + sft["response"]
    texts += ROLE_NAMES + (["tool"] if "turns" in sft else [])
    return list(dict.fromkeys(texts))


# --------------------------------------------------------------------------------------------------
# Prompts for SFT / RL / evaluation


@dataclass
class PromptSet:
    """Parallel per-prompt lists of a verl-schema parquet after the chat template and length handling."""

    prompt_ids: list[list[int]] = field(default_factory=list)  # chat template applied, generation prompt added
    prompts: list[list[dict[str, str]]] = field(default_factory=list)  # the chat lists as stored
    data_sources: list[str] = field(default_factory=list)
    ground_truths: list[str] = field(default_factory=list)
    extra_infos: list[dict[str, Any]] = field(default_factory=list)
    agent_names: list[str] = field(default_factory=list)  # the row's agent loop (stages/agent); column agent_name
    num_filtered: int = 0  # dropped: over max_prompt_length with filter_overlong_prompts
    num_truncated: int = 0  # cut to max_prompt_length by truncation=left|right

    def __len__(self) -> int:
        return len(self.prompt_ids)


def load_prompts(parquet_path: str | Path, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig,
                 tools: list[dict] | None = None) -> PromptSet:
    """Tokenize the prompts of a verl-schema parquet with the chat template; filter or truncate overlong ones.
    `tools`: the rollout's tool schemas, rendered into the prompts of tool_agent rows (as verl's tool agent loop
    does: the model reads which tools there are and how to call them)."""
    path = Path(parquet_path)
    table = pq.read_table(path)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing verl columns {missing} (has {table.column_names}); run data prep on it")
    rows = table.to_pylist()
    texts = [tokenizer.apply_chat_template(r["prompt"], tools=tools if r.get("agent_name") == "tool_agent" else None,
                                           add_generation_prompt=True, tokenize=False) for r in rows]
    all_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    out, limit = PromptSet(), cfg.max_prompt_length
    for i, (row, ids) in enumerate(zip(rows, all_ids, strict=True)):
        if len(ids) > limit:
            if cfg.filter_overlong_prompts:
                out.num_filtered += 1
                continue
            ids = _truncate(ids, cfg, f"row {i} of {path.name}")
            out.num_truncated += 1
        out.prompt_ids.append(list(ids))
        out.prompts.append(row["prompt"])
        out.data_sources.append(row["data_source"])
        out.ground_truths.append(row["reward_model"]["ground_truth"])
        out.extra_infos.append(row.get("extra_info") or {})
        out.agent_names.append(row.get("agent_name") or "single_turn")
    if out.num_filtered:
        logger.warning(
            "%s: dropped %d of %d prompts over data.max_prompt_length=%d (data.filter_overlong_prompts=true)",
            *(path.name, out.num_filtered, len(rows), limit),
        )
    if out.num_truncated:
        logger.warning(
            "%s: truncated %d of %d prompts to data.max_prompt_length=%d (data.truncation=%s)",
            *(path.name, out.num_truncated, len(rows), limit, cfg.truncation),
        )
    if rows and not out.prompt_ids:
        raise ValueError(f"{path}: all {len(rows)} prompts exceed data.max_prompt_length={limit}; raise it")
    return out


def _truncate(ids: list[int], cfg: DataConfig, where: str) -> list[int]:
    limit = cfg.max_prompt_length
    if cfg.truncation == "left":
        return ids[-limit:]  # keep the end: the question's tail and the generation prompt
    if cfg.truncation == "right":
        return ids[:limit]
    raise ValueError(
        f"{where}: the prompt is {len(ids)} tokens, over data.max_prompt_length={limit}; raise "
        "data.max_prompt_length, set data.truncation=left|right, or data.filter_overlong_prompts=true"
    )
