"""Validation metrics over n samples per prompt, per data_source: mean@n, best@n and maj@n.

mean@n is the average score of all samples; best@n the share of prompts with at least one correct
sample (pass@n); maj@n the score of the most common final answer (ties: the answer seen first), as
verl's `process_validation_metrics` reports. With n = 1 (greedy) all three equal the accuracy.

A sample's value is its `acc` when the reward function returned one (math_dapo's data_sources score -1/+1 with
acc 0/1), else its score: verl's val-core metrics likewise use `acc` when the reward gives it.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from stages.rewards.gsm8k import extract_solution


def final_answer(text: str) -> str:
    """The answer a response commits to: after '####' when present, else its last line."""
    answer = extract_solution(text, method="strict")
    if answer is not None:
        return answer
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def group_metrics(samples: list[dict], n: int, prefix: str = "val") -> dict[str, float]:
    """`samples`: dicts with prompt_index, data_source, score, response (and optionally acc). -> metric name
    -> value."""
    by_prompt: dict[int, list[dict]] = defaultdict(list)
    for s in samples:
        by_prompt[s["prompt_index"]].append(s)
    per_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for group in by_prompt.values():
        scores = [_value(s) for s in group]
        stats = per_source[group[0]["data_source"]]
        stats[f"mean@{n}"].append(sum(scores) / len(scores))
        stats[f"best@{n}"].append(max(scores))
        stats[f"maj@{n}"].append(_majority_score(group))
    metrics: dict[str, float] = {}
    totals: dict[str, list[float]] = defaultdict(list)
    for source, stats in sorted(per_source.items()):
        for name, values in stats.items():
            metrics[f"{prefix}/{source}/acc/{name}"] = sum(values) / len(values)
            totals[name].extend(values)
    for name, values in totals.items():
        metrics[f"{prefix}/acc/{name}"] = sum(values) / len(values)
    return metrics


def _majority_score(group: list[dict]) -> float:
    answers = [final_answer(s["response"]) for s in group]
    winner, _ = Counter(answers).most_common(1)[0]
    return _value(group[answers.index(winner)])


def _value(sample: dict) -> float:
    """The sample's `acc` if it has one (not None or NaN: a reward without acc), else its score."""
    acc = sample.get("acc")
    return float(sample["score"]) if acc is None or math.isnan(acc) else float(acc)
