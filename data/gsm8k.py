"""GSM8K (Cobbe et al., 2021) in verl's preprocessing: prompt = question + verl's step-by-step instruction.

The ground truth is the number after `#### ` in the reference answer, commas stripped (verl's
`examples/data_preprocess/gsm8k.py`). The SFT response is the whole reference answer, calculator
annotations (`<<48/2=24>>`) included, as in verl's SFT recipe. GSM8K's `test` split is written as our
`validation` split (and `extra_info.split` says `validation`, where verl writes `test`).

`data.gsm8k_path` is a local file or folder (read here, with row locations for bad-row messages), else a
hub dataset id loaded with `datasets.load_dataset(path, "main")`.

With `data.interaction=gsm8k` the RL rows are those of verl's `gsm8k_multiturn_w_interaction.py` (tool_agent,
`interaction_kwargs` {name, query, ground_truth}; data/files.py `with_interaction`), without its system prompt.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from data.files import Example, Splits, convert_rows, load_local, text_field
from data.reading import BadRow, Location
from infra.config_sections import DataConfig

logger = logging.getLogger(__name__)

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SOLUTION = re.compile(r"#### (\-?[0-9\.\,]+)")
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
HUB_SPLITS = {"train": "train", "validation": "test"}


def extract_solution(answer: str) -> str | None:
    """The number after the first `#### ` with commas stripped (verl's extract_solution), or None."""
    match = SOLUTION.search(answer)
    return match.group(1).replace(",", "") if match else None


def gsm8k_example(row: dict, index: int) -> Example:
    question = text_field(row, "question", "field 'question'")
    answer = text_field(row, "answer", "field 'answer'")
    ground_truth = extract_solution(answer)
    if ground_truth is None:
        raise BadRow("field 'answer' has no '#### <number>' final answer")
    return Example(
        prompt=[{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        ground_truth=ground_truth,
        response=answer,
        question=question,
        answer=answer,
        data_source=DATA_SOURCE,
        ability="math",
        index=index,
    )


def load_gsm8k(cfg: DataConfig, seed: int) -> Splits:
    """source=gsm8k: a local GSM8K-format file/folder, or the hub dataset `data.gsm8k_path`."""
    local = Path(cfg.gsm8k_path).expanduser()
    if (local / "main").is_dir():  # a snapshot of the hub dataset: its configs main/ and socratic/ (the same questions)
        logger.info("%s: reading its config 'main' (%s), as the hub's load_dataset(..., 'main') does", local,
                    local / "main")
        local = local / "main"
    if local.exists():
        return load_local(local, gsm8k_example, cfg, seed)
    if not HUB_ID.fullmatch(cfg.gsm8k_path):
        raise ValueError(
            f"data.gsm8k_path={cfg.gsm8k_path!r} is neither a local file/folder nor a hub id; "
            "use e.g. openai/gsm8k or a folder with train.jsonl and test.jsonl"
        )
    return _load_hub(cfg, cfg.gsm8k_path)


def _load_hub(cfg: DataConfig, dataset_id: str) -> Splits:
    import datasets  # heavy; only needed here

    logger.info("loading %s (config 'main') from the hub", dataset_id)
    dataset = datasets.load_dataset(dataset_id, "main")
    converted, skipped = {}, 0
    for ours, theirs in HUB_SPLITS.items():
        rows = ((Location(f"{dataset_id}[{theirs}]", i), row) for i, row in enumerate(dataset[theirs]))
        converted[ours], n = convert_rows(rows, gsm8k_example, cfg.bad_rows)
        skipped += n
    return Splits(converted["train"], converted["validation"], skipped)
