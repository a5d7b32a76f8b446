"""The worker side of the reward pool (stages/rewards/pool.py): load the reward function, then score the chunks the
parent sends, one result tuple per sample, `(index, score, components, error, dropped_keys, traceback, pred)`;
never raises for the user's code. Runs in the pool's forkserver processes.
"""

from __future__ import annotations

import functools
import math
import signal
import traceback
from multiprocessing.connection import Connection
from typing import Any

from stages.rewards import default_compute_score
from stages.rewards.custom import load_reward_fn

TRACEBACK_CHARS = 8000  # of a scorer's traceback, its end kept: the innermost frames and the error


def _load_fn(custom_path: str | None, custom_function: str, math_scorer: str):
    if custom_path is None:
        return functools.partial(default_compute_score, math_scorer=math_scorer)
    return load_reward_fn(custom_path, custom_function)


def worker_main(conn: Connection, custom_path: str | None, custom_function: str, math_scorer: str) -> None:
    """Load the reward function, say ready, then score chunks until None or the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which closes the pool
    try:
        fn = _load_fn(custom_path, custom_function, math_scorer)
    except Exception as exc:  # the user's file may raise anything on import: report it to the parent
        conn.send(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except EOFError:  # the parent is gone
            return
        if chunk is None:
            return
        for item in chunk:
            conn.send(_score_one(fn, item))


def _score_one(fn, item: tuple) -> tuple:
    """`(index, score, components, error, dropped_keys, traceback, pred)` of one sample; never raises for the user's
    code."""
    index, data_source, solution_str, ground_truth, extra_info = item
    try:
        raw = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                 extra_info=extra_info)
    except Exception as exc:  # the user's scorer may raise anything; one bad sample must not stop the run
        return index, 0.0, {}, f"error: {type(exc).__name__}: {exc}", (), _scorer_traceback(exc), None
    return (index, *_normalise(raw), None, _pred(raw))


def _pred(raw: Any) -> str | None:
    """The answer a dict result says the response gave (verl's `pred`, as math_dapo returns it), as text."""
    pred = raw.get("pred") if isinstance(raw, dict) else None
    return None if pred is None else str(pred)


def _scorer_traceback(exc: Exception) -> str:
    """The exception as Python prints it, from the scorer's frame on (this module's frame left out); its last
    TRACEBACK_CHARS."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
    return text if len(text) <= TRACEBACK_CHARS else "...\n" + text[-TRACEBACK_CHARS:]


def _as_float(value: Any) -> float | None:
    """`value` as a float if it is a number (bool, int, float, numpy or 0-dim torch scalar), else None."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # complex, multi-element arrays
        return None


def _normalise(raw: Any) -> tuple[float, dict[str, float], str | None, tuple[str, ...]]:
    """A float or a dict with "score" -> (score, numeric components, error, non-numeric keys dropped)."""
    extras: dict = {}
    if isinstance(raw, dict):
        if "score" not in raw:
            return 0.0, {}, f"error: KeyError: reward dict has no 'score' key (keys: {sorted(map(str, raw))})", ()
        extras = {str(k): v for k, v in raw.items() if k not in ("score", "pred")}  # pred: the answer, see _pred
        raw = raw["score"]
    score = _as_float(raw)
    if score is None:
        msg = f"reward is {type(raw).__name__}; return a float or a dict with a float 'score'"
        return 0.0, {}, f"error: TypeError: {msg}", ()
    components = {k: v for k, v in ((k, _as_float(v)) for k, v in extras.items()) if v is not None}
    dropped = tuple(k for k in extras if k not in components)
    if not math.isfinite(score):
        return 0.0, components, "nan", dropped
    return score, components, None, dropped
