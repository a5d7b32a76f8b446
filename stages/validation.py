"""Validation metrics over n samples per prompt, per data_source: mean@n, best@n, worst@n and maj@n.

mean@n is the average score of all samples; best@n the share of prompts with at least one correct
sample (pass@n); worst@n the share with every sample correct; maj@n the score of the most common final answer
(ties: the answer seen first), as verl's `process_validation_metrics` reports. With n = 1 (greedy) all four equal
the accuracy. The answer is the
reward's own `pred` where it returns one (math_dapo: "12" from "x = 12, so Answer: 12", as verl votes), else the
response's `####` answer, its last `\boxed{}` (MATH) or its last line. verl votes only where the reward gives a
`pred`; without one, a vote is for an answer and its value together, so that samples with the same answer and
different scores (the arithmetic task's "#### 61" without its work scores 0) never share a vote and the result
does not depend on their order.

A sample's value is its `acc` when the reward function returned one (math_dapo's data_sources score -1/+1 with
acc 0/1), else its score: verl's val-core metrics likewise use `acc` when the reward gives it.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from stages.rewards.gsm8k import extract_solution
from stages.rewards.math_reward import last_boxed_answer

if TYPE_CHECKING:
    from stages.agent import Rollout
    from stages.data_prep import PromptSet
    from stages.rollout.base import SamplingParams


def final_answer(text: str) -> str:
    """The answer a response commits to: after '####' when present, else its last box's content, else its last
    line."""
    answer = extract_solution(text, method="strict")
    if answer is None:
        answer = last_boxed_answer(text)
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
        scores = [sample_value(s) for s in group]
        stats = per_source[group[0]["data_source"]]
        stats[f"mean@{n}"].append(sum(scores) / len(scores))
        stats[f"best@{n}"].append(max(scores))
        stats[f"worst@{n}"].append(min(scores))
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
    votes = [s["pred"] if s.get("pred") is not None else (final_answer(s["response"]), sample_value(s))
             for s in group]
    winner, _ = Counter(votes).most_common(1)[0]
    return sample_value(group[votes.index(winner)])


def sample_value(sample: dict) -> float:
    """The sample's `acc` if it has one (not None or NaN: a reward without acc), else its score."""
    acc = sample.get("acc")
    return float(sample["score"]) if acc is None or math.isnan(acc) else float(acc)


def validation_samples(rollout: Rollout, prompts: PromptSet, rows: list[int], params: SamplingParams) -> list[dict]:
    """`params.n` samples of each prompt row, scored for correctness (no tool rewards): the `validation` table's
    rows, and what `group_metrics` takes."""
    trajectories = rollout.run(prompts, rows, params)
    result = rollout.score(prompts, rows, trajectories).result
    accs = [None if math.isnan(a) else a for a in result.components.get("acc", [math.nan] * len(trajectories))]
    return [{"prompt_index": t.prompt_index, "data_source": prompts.data_sources[rows[t.prompt_index]], "score": s,
             "acc": acc, "pred": pred, "response": t.text,
             "ground_truth": str(prompts.ground_truths[rows[t.prompt_index]]),
             "num_response_tokens": sum(t.response_mask), "finish_reason": t.finish_reason}
            for t, s, acc, pred in zip(trajectories, result.scores, accs, result.preds, strict=True)]


def start_summary(num_prompts: int, metrics: dict[str, float], n: int, temperature: float) -> tuple[str, float]:
    """What RL starts from, in words, from step 0's validation metrics (greedy and n samples); -> (text, pass@n)."""
    pass_n = metrics[f"val/acc/best@{n}"]
    text = (f"starting model on {num_prompts} held-out prompts: greedy acc {metrics['val/acc/mean@1']:.3f}, "
            f"mean@{n} {metrics[f'val/acc/mean@{n}']:.3f}, pass@{n} {pass_n:.3f} (temperature {temperature:g})")
    return text, pass_n
