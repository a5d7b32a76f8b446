"""One small generic registry: string keys (paper names in lowercase) to callables.

Used for advantage estimators, policy losses and KL estimators. Registering a key twice is an error (two
modules silently fighting over `grpo` is a bug), and an unknown key raises a `ValueError` that lists every
valid key, so a typo in a recipe fails at the first lookup with the fix in the message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named mapping from keys to entries, filled with the `register` decorator.

    Args:
        name: What the entries are, used in error messages (e.g. "advantage estimator").

    Example:
        >>> LOSSES = Registry("policy loss")
        >>> @LOSSES.register("vanilla")
        ... def vanilla(...): ...
        >>> LOSSES.get("vanilla")
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._entries: dict[str, T] = {}

    def register(self, key: str) -> Callable[[T], T]:
        """Decorator that adds the decorated object under `key` and returns it unchanged.

        Raises:
            ValueError: `key` is already registered.
        """

        def decorator(entry: T) -> T:
            if key in self._entries:
                existing = self._entries[key]
                where = f"{getattr(existing, '__module__', '?')}.{getattr(existing, '__qualname__', existing)}"
                raise ValueError(f"{self.name} {key!r} is already registered (by {where}); choose another key")
            self._entries[key] = entry
            return entry

        return decorator

    def get(self, key: str) -> T:
        """The entry registered under `key`.

        Raises:
            ValueError: `key` is unknown; the message lists the valid keys.
        """
        if key not in self._entries:
            raise ValueError(f"unknown {self.name} {key!r}; valid keys: {', '.join(self.keys())}")
        return self._entries[key]

    def keys(self) -> list[str]:
        """Registered keys, in registration order."""
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.name!r}, keys={self.keys()})"
