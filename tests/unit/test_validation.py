"""Validation metrics (stages/validation.py) on hand examples: a reward's own `acc` counts instead of its score."""

from __future__ import annotations

import math

import pytest

from stages.validation import group_metrics


def _sample(prompt: int, source: str, score: float, response: str, acc: float | None = None) -> dict:
    return {"prompt_index": prompt, "data_source": source, "score": score, "response": response, "acc": acc}


def test_acc_replaces_a_plus_minus_one_score():
    samples = [  # math_dapo: -1/+1 scores with acc 0/1; gsm8k: 1/0 scores, no acc (None or NaN)
        _sample(0, "math", 1.0, "Answer: 5", acc=1.0), _sample(0, "math", -1.0, "Answer: 6", acc=0.0),
        _sample(0, "math", -1.0, "Answer: 6", acc=0.0),
        _sample(1, "openai/gsm8k", 1.0, "#### 7"), _sample(1, "openai/gsm8k", 0.0, "#### 8", acc=math.nan),
        _sample(1, "openai/gsm8k", 0.0, "#### 8"),
    ]  # fmt: skip
    m = group_metrics(samples, 3)
    assert m["val/math/acc/mean@3"] == pytest.approx(1 / 3)  # (1 + 0 + 0) / 3, not (1 - 1 - 1) / 3
    assert m["val/math/acc/best@3"] == 1.0
    assert m["val/math/acc/worst@3"] == 0.0 and m["val/acc/worst@3"] == 0.0  # no prompt has all three right
    assert m["val/math/acc/maj@3"] == 0.0  # "6" twice: its acc 0, not its score -1
    assert m["val/openai/gsm8k/acc/mean@3"] == pytest.approx(1 / 3)  # scores (1 + 0 + 0) / 3
    assert m["val/acc/mean@3"] == pytest.approx(1 / 3)  # over both prompts: (1/3 + 1/3) / 2
    assert m["val/acc/maj@3"] == 0.0


def test_evaluation_acc_counts_the_rewards_own_acc_as_validation_does():
    """A reward of {"score": 0.9, "acc": 1} is correct: evaluation counted score >= 1 (0.25 here) while validation's
    mean@1 counted acc (0.75) for the same samples."""
    from stages.evaluate import ALL, score_table

    rows = [{"prompt_index": i, "data_source": "custom", "score": score, "acc": acc, "response": "r"}
            for i, (score, acc) in enumerate([(0.9, 1.0), (0.9, 1.0), (1.0, 1.0), (0.0, 0.0)])]
    scores, _ = score_table(rows, [], 1)
    assert scores[ALL]["acc"] == 0.75 == group_metrics(rows, 1)["val/acc/mean@1"]


def test_majority_votes_on_the_rewards_own_answer():
    """math_dapo's pred: three right answers worded differently outvote two identical wrong ones (the vote on each
    response's last line split them three ways: maj@5 was 0)."""
    samples = [_sample(0, "math", 1.0, text, acc=1.0) for text in ("x = 12, so\nAnswer: 12", "it is 12",
                                                                     "so it is\nAnswer: $12$")]
    samples += [_sample(0, "math", -1.0, "I think\nAnswer: 7", acc=0.0) for _ in range(2)]
    assert group_metrics(samples, 5)["val/acc/maj@5"] == 0.0  # no pred: last lines "Answer: 7" x2 win
    for s, pred in zip(samples, ["12", "12", "12", "7", "7"]):
        s["pred"] = pred
    assert group_metrics(samples, 5)["val/acc/maj@5"] == 1.0


def test_without_a_pred_answers_that_score_differently_never_share_a_vote():
    """The arithmetic task: "#### 61" without its work scores 0, with it 1. Both voted "61" and maj@5 was the score
    of whichever came first (1.0 or 0.0 by order); now (61, 1) and (61, 0) are two votes, the larger one wins."""
    work, shortcut = "23 + 45 = 68\n68 - 7 = 61\n#### 61", "#### 61"
    for order in ([work, shortcut, work, work, "#### 5"], [shortcut, work, work, work, "#### 5"]):
        samples = [_sample(0, "synthetic/arithmetic", float(t == work), t) for t in order]
        assert group_metrics(samples, 5)["val/acc/maj@5"] == 1.0, order


def test_without_a_pred_a_boxed_answer_is_the_vote():
    """MATH's scorer reads the last box: the vote on last lines split "\\boxed{5}." and "Hence \\boxed{5}." apart."""
    texts = ["\\boxed{7}", "So\n\\boxed{5}.", "Hence \\boxed{5}.", "We get \\boxed{5}."]
    samples = [_sample(0, "math", float("{5}" in t), t) for t in texts]
    assert group_metrics(samples, 4)["val/acc/maj@4"] == 1.0
