"""MATH scorer with math-verify, as verl's `utils/reward_score/math_verify.py` (rl.reward.math_scorer=math_verify).

The ground truth is wrapped in `\\boxed{}` unless it already has one and parsed as LaTeX; the solution is
parsed as a plain expression or LaTeX (math-verify takes the last boxed/final answer); `verify` compares
them symbolically and numerically. Returns 1.0 or 0.0; an unparseable side scores 0.0.

math-verify's timeouts use `signal.alarm`, which only works in the main thread; in other threads they are
turned off (a process pool, where rewards are meant to run, calls this in the main thread).
"""

from __future__ import annotations

import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

TIMEOUT_S = 5


def compute_score(solution_str: str, ground_truth: str, timeout_score: float = 0.0) -> float:
    gold_text = ground_truth if "\\boxed" in ground_truth else f"\\boxed{{{ground_truth}}}"
    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(gold_text, extraction_config=[LatexExtractionConfig()], parsing_timeout=timeout)
        pred = parse(
            solution_str, extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()], parsing_timeout=timeout
        )
        if not gold or not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
    except TimeoutException:  # raised past math-verify's own handlers only by an outer alarm
        return timeout_score
