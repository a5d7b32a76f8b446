"""GSM8K scorer, as verl's `utils/reward_score/gsm8k.py`.

Only the last 300 characters of the solution are searched (an answer, if any, is at the end; regexes on
long strings are slow). strict: the number after the last `#### `, commas and `$` stripped (this also
rewards the format). flexible: the last number in the text. The score is `score` for an answer equal to
the ground truth, `format_score` for a wrong one, 0 for none.

Deviation from verl: flexible also strips commas and a trailing period from the number it finds (verl
compares "1,000" and "72." verbatim, so they never match a ground truth).
"""

from __future__ import annotations

import re

SOLUTION_CLIP_CHARS = 300
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer in `solution_str` by `method` ('strict' or 'flexible'), or None if there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method={method!r}: use 'strict' or 'flexible'")
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for number in reversed(NUMBER.findall(tail)):
        number = number.replace(",", "").rstrip(".")
        if number not in ("", "-"):
            return number
    return None


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score
