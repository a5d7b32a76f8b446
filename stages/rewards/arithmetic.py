"""Scorer of the synthetic arithmetic task (data/synthetic.py): the answer must be right, and so must the work.

1.0 when the response has one `####` and its `#### N` answer (GSM8K's strict extraction, commas stripped; "07"
counts as 7) equals the ground truth AND the worked lines before it are a valid
derivation: each line is `a op b = c` with correct arithmetic, the first starts from the question's first
operand, each next one from the previous result, the operands and operators follow the question
(`extra_info["question"]`, when given), and the last result is N. Else 0.0.

Why the work counts: short problems have answers in a small range, so a response with wrong steps often
lands on the right number by chance (45% of a tiny SFT model's correct samples did). An outcome-only
reward then teaches wrong arithmetic; this one rewards exactly the behaviour the task is about.
"""

from __future__ import annotations

import re

from stages.rewards.gsm8k import extract_solution

STEP = re.compile(r"^\s*(-?\d+) ([+\-*]) (-?\d+) = (-?\d+)\s*$")
APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    if solution_str.count("####") != 1:  # hedged answers: the work before the first, the answer after the last
        return 0.0
    answer = _int(extract_solution(solution_str, "strict"))
    if answer is None or answer != _int(ground_truth.replace(",", "")):
        return 0.0
    question = (extra_info or {}).get("question")
    return float(valid_work(solution_str.split("####")[0], answer, question))


def valid_work(work: str, answer: int, question: str | None) -> bool:
    steps = [STEP.match(line) for line in work.strip().splitlines() if line.strip()]
    if not steps or any(m is None for m in steps):
        return False
    expected = _question_terms(question) if question else None
    value = None
    for i, m in enumerate(steps):
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        if APPLY[op](a, b) != c or (value is not None and a != value):
            return False
        if expected is not None and (i >= len(expected[1]) or (i == 0 and a != expected[0][0])
                                     or (op, b) != (expected[1][i], expected[0][i + 1])):
            return False
        value = c
    complete = expected is None or len(steps) == len(expected[1])
    return complete and value == answer


def _question_terms(question: str) -> tuple[list[int], list[str]]:
    """Operands and operators of 'What is (4 - 2) * 3?' -> ([4, 2, 3], ['-', '*'])."""
    tokens = re.findall(r"-?\d+|[+\-*]", question.replace("(", " ").replace(")", " "))
    operands = [int(t) for t in tokens if t not in APPLY]
    operators = [t for t in tokens if t in APPLY]
    return operands, operators


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:  # "12.5": not an integer answer
        return None
