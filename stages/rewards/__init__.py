"""Rule-based rewards by data_source, with verl's signature `(data_source, solution_str, ground_truth, extra_info)`.

`default_compute_score` dispatches through `SCORERS`, a data_source -> scorer registry (a scorer takes
`(solution_str, ground_truth, extra_info)` and returns a float). A task of one's own plugs in a custom function by
file path and name (`stages.rewards.custom.load_reward_fn`) instead of this default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from stages.rewards import arithmetic, gsm8k, math

Scorer = Callable[[str, str, dict | None], float]
SCORERS: dict[str, Scorer] = {}
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")


def register_scorer(data_sources: Iterable[str], scorer: Scorer) -> None:
    """Route each of `data_sources` to `scorer`; a data_source can be registered once."""
    for data_source in data_sources:
        if data_source in SCORERS:
            raise ValueError(f"data_source {data_source!r} already has a scorer: {SCORERS[data_source].__module__}")
        SCORERS[data_source] = scorer


register_scorer(["openai/gsm8k", "synthetic/calculator"],
                lambda text, truth, _extra: gsm8k.compute_score(text, truth))  # strict: '#### N' alone
register_scorer(["synthetic/arithmetic"], arithmetic.compute_score)
register_scorer(MATH_SOURCES, lambda text, truth, _extra: math.compute_score(text, truth))


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """Score one response with the scorer registered for its data_source."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise ValueError(
            f"no reward function for data_source {data_source!r}; known: {sorted(SCORERS)}. For another task, "
            "use a custom reward function: a Python file path and the name of a function "
            "(data_source, solution_str, ground_truth, extra_info) -> float (see stages/rewards/custom.py)"
        )
    return float(scorer(solution_str, ground_truth, extra_info))
