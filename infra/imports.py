"""Import a user's object by name: `package.module.Name` or `path/to/file.py:Name`.

A file is imported under a module name derived from its resolved path and registered in `sys.modules`, so it
is imported once per process (like verl's `custom_reward_function`). Errors raised by the file's own code while
importing propagate as they are.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def import_file(path: str, what: str) -> ModuleType:
    """The Python file at `path` as a module; `what` names it in errors (e.g. "custom reward file")."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ValueError(f"{what} {path!r} not found; give the path of a .py file")
    module_name = f"rlpipe_user_{file.stem}_{hashlib.sha256(str(file).encode()).hexdigest()[:12]}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ValueError(f"{what} {path!r} cannot be imported as Python; give a .py file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # before exec, so that dataclasses and pickling inside the file work
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return module


def load_object(spec: str, what: str) -> Any:
    """`package.module.Name` or `path/to/file.py:Name` -> the object; ValueError naming `what` and the fix."""
    if ":" in spec:
        path, _, name = spec.rpartition(":")
        module = import_file(path, what)
    else:
        module_name, _, name = spec.rpartition(".")
        if not module_name:
            raise ValueError(f"{what} {spec!r}: give package.module.Name or path/to/file.py:Name")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"{what} {spec!r}: cannot import {module_name!r} ({exc})") from None
    if not hasattr(module, name):
        public = sorted(k for k in vars(module) if not k.startswith("_"))
        raise ValueError(f"{what} {spec!r}: {module.__name__} has no {name!r}; it defines {public[:20]}")
    return getattr(module, name)
