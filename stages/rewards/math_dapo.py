"""DAPO's math scorer, as verl's `utils/reward_score/math_dapo.py`: data_sources `math`, `math_dapo`,
`math_dapo_reasoning` and every one starting with `aime`.

Only the last 300 characters of the response are read. The answer is the text after the last `Answer:` there
(case-insensitive, spaces and line breaks around the colon allowed) up to the end of its line; it and the
ground truth are normalised alike (below) and compared as strings. A right answer scores +1, a wrong or
missing one -1 (not 0: DAPO's reward). The result is verl's dict `{"score": ±1.0, "acc": bool, "pred":
normalised answer}`; the reward pool logs `acc` as `reward/acc/mean` (and the `reward_acc` column, which
`rl.algorithm.filter_groups_metric=acc` reads) and leaves the string `pred` out (one warning per pool says so).

`strict_box=True` is verl's `strict_box_verify`: the content of the last `\\boxed{...}` in the last 100 of
those characters must equal the ground truth exactly, without normalisation; `pred` is that content (None
without a box). verl's `pause_tokens_index` (count the 100 characters from a pause token) is not implemented.

Normalisation: Minerva's final-answer normalisation (Lewkowycz et al. 2022, "Solving Quantitative Reasoning
Problems with Language Models", appendix D), in its order:
1. keep what follows the last `=` ("x = 5" -> " 5");
2. literal rewrites (`REWRITES`: articles, `\\$`, every space, `\\text{and}` -> `,`, ...) then removals
   (`REMOVED`: unit words such as "cm" or "dollars", `\\text{}` leftovers, degree marks, `\\dots`, `{,}`);
3. of text between two `$`, keep the first `$...$` of each line;
4. unwrap `\\text{}`, `\\textbf{}`, `\\overline{}` (to the first `}`) and `\\boxed{}` (to the last `}`);
5. brace TeX shorthand: `\\frac12` -> `\\frac{1}{2}`, `\\sqrt3` -> `\\sqrt{3}`;
6. drop `$`; drop the commas of a number made of digits and commas ("1,000" -> "1000"); strip.
Deviation from the paper, as verl has it: the paper's removals also drop "ft"; verl's (and so this) do not.
"""

from __future__ import annotations

import re

from stages.rewards.math_reward import closing_brace

CLIP_CHARS = 300  # the longest answer in MATH-500 is 159 characters
STRICT_BOX_CHARS = 100
NO_ANSWER = "[INVALID]"  # what verl normalises and compares when no `Answer:` line is found
ANSWER = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)

REWRITES = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)  # fmt: skip
REMOVED = (  # in this order: \text{s} and \text{}^2 go before \text{}
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip

# `.` of the paper's patterns never matches a line break: [^\n] says so explicitly
FIRST_MATH_SPAN = re.compile(r"[^\n]*?\$([^\n]*?)\$[^\n]*")
UNWRAP = tuple(re.compile(p) for p in (r"\\text\{([^\n]*?)\}", r"\\textbf\{([^\n]*?)\}",
                                       r"\\overline\{([^\n]*?)\}", r"\\boxed\{([^\n]*)\}"))
FRAC_SHORTHAND = re.compile(r"frac([^{])([^\n])")
SQRT_SHORTHAND = re.compile(r"sqrt([^{])")


def compute_score(
    solution_str: str, ground_truth: str, strict_box: bool = False
) -> dict[str, float | bool | str | None]:
    tail = solution_str[-CLIP_CHARS:]
    if strict_box:
        pred = last_boxed_content(tail[-STRICT_BOX_CHARS:])
        correct = pred == ground_truth
    else:
        found = ANSWER.findall(tail)
        pred = normalize_final_answer(found[-1] if found else NO_ANSWER)
        correct = pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def last_boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, or None (no box, or its brace is never closed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = closing_brace(text, start + len("\\boxed"))
    return None if end is None else text[start + len("\\boxed{"):end]


def normalize_final_answer(answer: str) -> str:
    """Minerva's normalisation of a final answer (module docstring, steps 1-6)."""
    text = answer.split("=")[-1]
    for old, new in REWRITES:
        text = text.replace(old, new)
    for token in REMOVED:
        text = text.replace(token, "")
    text = FIRST_MATH_SPAN.sub(lambda m: f"${m[1]}$", text)
    for pattern in UNWRAP:
        text = pattern.sub(lambda m: m[1], text)
    text = FRAC_SHORTHAND.sub(lambda m: f"frac{{{m[1]}}}{{{m[2]}}}", text)
    text = SQRT_SHORTHAND.sub(lambda m: f"sqrt{{{m[1]}}}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()
