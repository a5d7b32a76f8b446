"""Rule-based rewards by data_source, with verl's signature `(data_source, solution_str, ground_truth, extra_info)`.

A data_source means what it means in verl's `default_compute_score` (verl/utils/reward_score/__init__.py):

    data_source                                    scorer                                  score
    openai/gsm8k                                   gsm8k.py, strict: the last `#### N`     1 / 0
    lighteval/MATH, DigitalLearningGmbH/MATH-      math_scorer="verl" (default): verl's    1 / 0
      lighteval, HuggingFaceH4/MATH-500              math_reward.py, last \\boxed{}, string
                                                     equivalence; "math_verify": math-verify
    math, math_dapo, math_dapo_reasoning, aime*    math_dapo.py: the last `Answer:`,       dict, +1 / -1
                                                     Minerva normalisation
    synthetic/arithmetic (ours)                    arithmetic.py: `#### N` and its work    1 / 0
    synthetic/calculator (ours)                    gsm8k.py, strict                        1 / 0

The one named difference from verl is a choice, `math_scorer` (rl.reward.math_scorer, the reward pool passes it
here): "math_verify" scores the three MATH datasets with math-verify, which verl's dispatch only suggests in a
comment. The sources verl scores with code this project does not have (`VERL_ONLY`: prime_math's numina_*, code
run in sandboxes, geometry3k, search-R1 QA) raise a ValueError that says so and how to plug in one's own reward
function by file path and name (`stages.rewards.custom.load_reward_fn`).

`default_compute_score` dispatches through `SCORERS` (exact data_sources) and `SCORER_PREFIXES` (`aime`); a
scorer takes `(solution_str, ground_truth, extra_info)` and returns a float or verl's dict with `score`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from stages.rewards import arithmetic, gsm8k, math_dapo, math_reward, math_verify

Scorer = Callable[[str, str, dict | None], float | dict]
SCORERS: dict[str, Scorer] = {}
SCORER_PREFIXES: dict[str, Scorer] = {}  # a data_source starting with the key; exact ones first
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math", "math_dapo", "math_dapo_reasoning")
MATH_SCORERS: dict[str, Scorer] = {  # rl.reward.math_scorer -> the scorer of MATH_SOURCES
    "verl": lambda text, truth, _extra: math_reward.compute_score(text, truth),
    "math_verify": lambda text, truth, _extra: math_verify.compute_score(text, truth),
}
VERL_ONLY = {  # data_source -> verl's scorer (verl/utils/reward_score/), not in this project
    **dict.fromkeys([f"numina_{s}" for s in ("aops_forum", "synthetic_math", "amc_aime", "synthetic_amc", "cn_k12",
                                             "olympiads")], "prime_math"),
    **dict.fromkeys(["codecontests", "apps", "codeforces", "taco"], "sandbox_fusion (or prime_code), which runs code"),
    "hiyouga/geometry3k": "geo3k",
    **dict.fromkeys([f"searchR1_{s}" for s in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique",
                                               "bamboogle")], "search_r1_like_qa_em"),
}


def register_scorer(data_sources: Iterable[str], scorer: Scorer) -> None:
    """Route each of `data_sources` to `scorer`; a data_source can be registered once."""
    for data_source in data_sources:
        if data_source in SCORERS:
            raise ValueError(f"data_source {data_source!r} already has a scorer: {SCORERS[data_source].__module__}")
        SCORERS[data_source] = scorer


def _dapo(text: str, truth: str, _extra: dict | None) -> dict:
    return math_dapo.compute_score(text, truth)


register_scorer(["openai/gsm8k", "synthetic/calculator"],
                lambda text, truth, _extra: gsm8k.compute_score(text, truth))  # strict: '#### N' alone
register_scorer(["synthetic/arithmetic"], arithmetic.compute_score)
register_scorer(MATH_SOURCES, MATH_SCORERS["verl"])  # verl's meaning; math_scorer may choose another
register_scorer(DAPO_SOURCES, _dapo)
SCORER_PREFIXES["aime"] = _dapo


def scorer_for(data_source: str, math_scorer: str = "verl") -> Scorer:
    """The scorer of `data_source`, with `math_scorer` choosing that of the MATH datasets."""
    if math_scorer not in MATH_SCORERS:
        raise ValueError(f"math_scorer={math_scorer!r}: use one of {sorted(MATH_SCORERS)} (rl.reward.math_scorer)")
    if data_source in MATH_SOURCES:
        return MATH_SCORERS[math_scorer]
    scorer = SCORERS.get(data_source)
    if scorer is None:
        scorer = next((s for prefix, s in SCORER_PREFIXES.items() if data_source.startswith(prefix)), None)
    if scorer is None:
        raise ValueError(_unknown_source(data_source))
    return scorer


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None,
    math_scorer: str = "verl",
) -> float | dict:
    """Score one response with the scorer of its data_source: a float, or a dict with "score" (as verl's)."""
    result = scorer_for(data_source, math_scorer)(solution_str, ground_truth, extra_info)
    return result if isinstance(result, dict) else float(result)


def _unknown_source(data_source: str) -> str:
    custom = ("To score it, write a reward function of your own, def compute_score(data_source, solution_str, "
              "ground_truth, extra_info=None) -> float or a dict with 'score', and set rl.reward.custom_path="
              "<file.py> rl.reward.custom_function=compute_score (see stages/rewards/custom.py)")
    if data_source in VERL_ONLY:
        return (f"no reward function for data_source {data_source!r}: verl scores it with its "
                f"{VERL_ONLY[data_source]} scorer, which this project does not have. {custom}")
    prefixes = ", ".join(f"any starting with {p!r}" for p in SCORER_PREFIXES)
    return f"no reward function for data_source {data_source!r}; known: {sorted(SCORERS)} and {prefixes}. {custom}"
