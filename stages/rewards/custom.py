"""Load a user's verl-style reward function from a Python file: `(data_source, solution_str, ground_truth,
extra_info) -> float | dict with "score"`.

The file is imported under a module name derived from its path and registered in `sys.modules`, like
verl's `custom_reward_function`, so that it is imported once per process. Errors raised by the file's own
code while importing propagate as they are.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def load_reward_fn(path: str, name: str) -> Callable:
    """The function `name` of the Python file at `path`, checked to accept verl's reward arguments."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ValueError(f"custom reward file {path!r} not found; give the path of a .py file")
    module_name = f"rlpipe_custom_reward_{hashlib.sha256(str(file).encode()).hexdigest()[:12]}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ValueError(f"custom reward file {path!r} cannot be imported as Python; give a .py file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[module_name] = module
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise ValueError(f"custom reward file {path!r} has no function {name!r}; its functions: {found}")
    _check_signature(fn, f"{path}:{name}")
    return fn


def _check_signature(fn: Callable, where: str) -> None:
    """The function must take the four arguments both positionally and by these names (verl passes keywords)."""
    signature = inspect.signature(fn)
    try:
        signature.bind(*ARGS)
        signature.bind(**dict.fromkeys(ARGS))
    except TypeError as exc:
        raise ValueError(
            f"custom reward {where}{signature} cannot be called as f(data_source, solution_str, ground_truth, "
            f"extra_info) ({exc}); define it as def {fn.__name__}(data_source, solution_str, ground_truth, "
            "extra_info=None)"
        ) from None
