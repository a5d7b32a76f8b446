"""MATH scorer by string equivalence, as verl's `utils/reward_score/math_reward.py` (rl.reward.math_scorer=verl).

verl scores `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval` and `HuggingFaceH4/MATH-500` with the
MATH benchmark's own checker (Hendrycks et al. 2021, "Measuring Mathematical Problem Solving With the MATH
Dataset", as lm-evaluation-harness ships it): the answer is the content of the last `\\boxed{...}` of the
whole response; it and the ground truth are normalised as strings and compared. 1.0 when equal, else 0.0
(no box, unbalanced braces, a wrong answer).

Finding the answer, as verl does:
- if the response contains `\\boxed ` (with a space) anywhere, the answer is the text after its last
  occurrence up to the next `$`, even when a `\\boxed{}` comes later;
- else the last `\\boxed` must open a brace group, `\\boxed{...}`, and its content is the answer. (verl also
  looks for `\\fbox{}` when there is no `\\boxed`, but then fails to unwrap it: `\\fbox` answers score 0, here too.)

Normalisation, in this order: drop newlines, `\\!`; `\\\\` -> `\\`; tfrac/dfrac -> frac; drop `\\left`,
`\\right`, degree marks, `\\$`; cut units (everything from a single `\\text{ ` on); drop `\\%`; `.5` -> `0.5`;
keep the right side of `x = 5` (left side of at most two characters); `\\sqrt3` -> `\\sqrt{3}`; drop spaces;
`\\frac12` -> `\\frac{1}{2}`; `0.5` -> `\\frac{1}{2}`; `3/4` (two plain integers) -> `\\frac{3}{4}`. Where verl's
normaliser raises (two unit cuts; `\\sqrt` or `\\frac` at the very end), the two strings are compared verbatim.
"""

from __future__ import annotations

import re

CANONICAL_INT = re.compile(r"0|-?[1-9][0-9]*")  # an int that prints back as itself: "7", "-12"; not "07", "+7"
DROPPED = ("\\left", "\\right", "^{\\circ}", "^\\circ", "\\$")


def compute_score(solution_str: str, ground_truth: str) -> float:
    answer = last_boxed_answer(solution_str)
    return 1.0 if answer is not None and is_equiv(answer, ground_truth) else 0.0


def closing_brace(text: str, open_at: int) -> int | None:
    """Index of the `}` that closes the `{` at `open_at`, or None if it is never closed."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def last_boxed_answer(text: str) -> str | None:
    """The content of the response's last box (see the module docstring), or None if there is none."""
    if "\\boxed " in text:  # "\boxed 5$"
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0 or not text.startswith("\\boxed{", start):
        return None
    end = closing_brace(text, start + len("\\boxed"))
    return None if end is None else text[start + len("\\boxed{"):end]


def is_equiv(answer: str, ground_truth: str) -> bool:
    norm_answer, norm_truth = normalize(answer), normalize(ground_truth)
    if norm_answer is None or norm_truth is None:
        return answer == ground_truth
    return norm_answer == norm_truth


def normalize(answer: str) -> str | None:
    """MATH's answer normalisation (module docstring); None where it does not apply."""
    text = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    for token in DROPPED:
        text = text.replace(token, "")
    if "\\text{ " in text:  # "5 \text{ cm}": units on the right
        before, *after = text.split("\\text{ ")
        if len(after) > 1:
            return None
        text = before
    text = text.replace("\\\\%", "").replace("\\%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if text.startswith("."):
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 5", "k=5"
        text = sides[1]
    text = _brace_sqrt(text)
    if text is None:
        return None
    text = _brace_fracs(text.replace(" ", ""))
    if text is None:
        return None
    if text == "0.5":
        return "\\frac{1}{2}"
    return _slash_to_frac(text)


def _brace_sqrt(text: str) -> str | None:
    """`\\sqrt3` -> `\\sqrt{3}` (one character); None for a `\\sqrt` at the very end."""
    head, *tails = text.split("\\sqrt")
    parts = [head]
    for tail in tails:
        if not tail:
            return None
        parts.append(tail if tail[0] == "{" else f"{{{tail[0]}}}{tail[1:]}")
    return "\\sqrt".join(parts)


def _brace_fracs(text: str) -> str | None:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{2}` -> `\\frac{1}{2}`; None for a `\\frac` at the very end, `text`
    unchanged for a `\\frac` followed by one character only."""
    head, *tails = text.split("\\frac")
    parts = [head]
    for tail in tails:
        if not tail:
            return None
        if tail[0] == "{":
            parts.append(tail)
        elif len(tail) == 1:
            return text
        elif tail[1] == "{":
            parts.append(f"{{{tail[0]}}}{tail[1:]}")
        else:
            parts.append(f"{{{tail[0]}}}{{{tail[1]}}}{tail[2:]}")
    return "\\frac".join(parts)


def _slash_to_frac(text: str) -> str:
    """`3/4` -> `\\frac{3}{4}` when both sides are plain integers."""
    sides = text.split("/")
    if len(sides) == 2 and all(CANONICAL_INT.fullmatch(side) for side in sides):
        return f"\\frac{{{sides[0]}}}{{{sides[1]}}}"
    return text
