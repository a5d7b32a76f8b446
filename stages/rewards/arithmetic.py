"""Scorer of the synthetic arithmetic task (data/synthetic.py): exact integer match of the `#### N` answer.

The answer is extracted as GSM8K's strict method does (last `#### N` in the last 300 characters, commas
stripped); it scores 1.0 when it is an integer equal to the ground truth ("07" counts as 7), else 0.0.
"""

from __future__ import annotations

from stages.rewards.gsm8k import extract_solution


def compute_score(solution_str: str, ground_truth: str) -> float:
    answer = extract_solution(solution_str, "strict")
    if answer is None:
        return 0.0
    try:
        return float(int(answer) == int(ground_truth))
    except ValueError:  # "12.5", "1.2.": not an integer answer
        return 0.0
