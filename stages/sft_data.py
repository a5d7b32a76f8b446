"""SFT data: the SFT parquet's rows -> token ids (prompt through the chat template, response + EOS; a multi-turn
row's tool messages outside the loss), and examples -> batches in the RL trainer's layout with the loss tokens as
`response_mask`. Long prompts follow data.* (filter, truncate or error), and every dropped, truncated or cut row is
counted in a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from infra.config_sections import DataConfig
from stages.batch import Batch, build_batch
from stages.model.loading import chat_prompt_ids, tool_turn_ids

logger = logging.getLogger(__name__)


@dataclass
class SFTExample:
    input_ids: list[int]
    num_prompt_tokens: int
    loss_mask: list[int] | None = None  # multi-turn: 1 on assistant tokens, 0 on tool tokens (None: all ones)


def tokenize_sft(path: Path, tokenizer, cfg: DataConfig, tools: list[dict] | None = None) -> list[SFTExample]:
    """Prompt through the chat template + response + EOS; long prompts follow data.* (filter/truncate). `tools`
    (the rollout's tool schemas) are rendered into the prompts of tool_agent rows, as RL's (data_prep.load_prompts)."""
    names = pq.read_schema(path).names
    columns = ["prompt", "response"] + [name for name in ("turns", "agent_name") if name in names]
    table = pq.read_table(path, columns=columns).to_pylist()
    examples, num_filtered, num_truncated, num_cut = [], 0, 0, 0
    for i, row in enumerate(table):
        prompt = chat_prompt_ids(tokenizer, row["prompt"], tools if row.get("agent_name") == "tool_agent" else None)
        if len(prompt) > cfg.max_prompt_length:
            if cfg.filter_overlong_prompts:
                num_filtered += 1
                continue
            prompt, num_truncated = _truncate(prompt, cfg), num_truncated + 1
        try:
            response, mask = response_ids(tokenizer, row)
        except ValueError as exc:
            raise ValueError(f"{path.name} row {i}: {exc}") from None
        if len(response) > cfg.max_response_length:
            response, num_cut = response[: cfg.max_response_length], num_cut + 1
            mask = mask and mask[: cfg.max_response_length]
        examples.append(SFTExample(prompt + response, len(prompt), mask))
    if num_filtered or num_truncated or num_cut:
        logger.warning("%s: of %d rows, %d prompts over data.max_prompt_length dropped, %d truncated (data.truncation="
                       "%s), %d responses cut to data.max_response_length", path.name, len(table), num_filtered,
                       num_truncated, cfg.truncation, num_cut)
    if not examples:
        raise ValueError(f"{path}: no SFT examples left; raise data.max_prompt_length")
    return examples


def response_ids(tokenizer, row: dict) -> tuple[list[int], list[int] | None]:
    """The target ids of an SFT row and, for a multi-turn row, its loss mask. A multi-turn row's ids are laid out
    as the tool_agent loop lays out a rollout: each assistant message + EOS (loss), the tool messages between
    them through the chat template with the next assistant header (no loss)."""
    turns = row.get("turns") or []
    if not turns:
        return tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id], None
    ids: list[int] = []
    mask: list[int] = []
    tools: list[dict] = []
    for message in turns:
        if message["role"] == "tool":
            tools.append(message)
            continue
        if tools:
            part = tool_turn_ids(tokenizer, tools)
            ids, mask, tools = ids + part, mask + [0] * len(part), []
        part = tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, mask = ids + part, mask + [1] * len(part)
    if tools:  # nothing would train on their results; a row cut short
        raise ValueError(f"its turns end with {len(tools)} tool message(s): the last turn must be the assistant's "
                         "answer")
    return ids, mask


def _truncate(prompt: list[int], cfg: DataConfig) -> list[int]:
    if cfg.truncation == "error":
        raise ValueError(
            f"prompt of {len(prompt)} tokens > data.max_prompt_length={cfg.max_prompt_length}; raise it, "
            "or set data.filter_overlong_prompts=true or data.truncation=left|right"
        )
    n = cfg.max_prompt_length
    return prompt[-n:] if cfg.truncation == "left" else prompt[:n]


def sft_batch(examples: list[SFTExample], pad_id: int) -> Batch:
    """The examples in the RL trainer's layout (stages/batch.py: left-padded prompts, right-padded responses);
    `response_mask` marks the loss tokens (a multi-turn example's tool tokens are not among them)."""
    prompts = [e.input_ids[: e.num_prompt_tokens] for e in examples]
    responses = [e.input_ids[e.num_prompt_tokens :] for e in examples]
    masks = [e.loss_mask or [1] * len(r) for e, r in zip(examples, responses)]
    return build_batch(prompts, responses, [[0.0] * len(r) for r in responses], pad_id, response_masks=masks)


def num_target_tokens(examples: list[SFTExample]) -> int:
    """Loss tokens: the responses' tokens, but for a multi-turn example's tool tokens (at least 1: a divisor)."""
    return max(1, sum(sum(e.loss_mask) if e.loss_mask is not None else len(e.input_ids) - e.num_prompt_tokens
                      for e in examples))
