"""Load a user's verl-style reward function from a Python file: `(data_source, solution_str, ground_truth,
extra_info) -> float | dict with "score"`.

The file is imported once per process (infra/imports.py), like verl's `custom_reward_function`. Errors raised
by the file's own code while importing propagate as they are.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from infra.imports import import_file

ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def load_reward_fn(path: str, name: str) -> Callable:
    """The function `name` of the Python file at `path`, checked to accept verl's reward arguments."""
    module = import_file(path, "custom reward file")
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise ValueError(f"custom reward file {path!r} has no function {name!r}; its functions: {found}")
    _check_signature(fn, f"{path}:{name}")
    return fn


def _check_signature(fn: Callable, where: str) -> None:
    """The function must take the four arguments by these names: verl and the reward pool pass keywords, so
    keyword-only arguments and `**kwargs` are fine."""
    signature = inspect.signature(fn)
    try:
        signature.bind(**dict.fromkeys(ARGS))
    except TypeError as exc:
        raise ValueError(
            f"custom reward {where}{signature} cannot be called as f(data_source=..., solution_str=..., "
            f"ground_truth=..., extra_info=...) ({exc}); define it as def {fn.__name__}(data_source, solution_str, "
            "ground_truth, extra_info=None)"
        ) from None
