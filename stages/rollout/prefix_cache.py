"""Which parked KV row holds which token prefix, for the cuda engine's reuse of earlier turns.

A multi-turn trajectory asks the engine for its next turn with the prompt `earlier prompt + the model's reply +
tool tokens`. When the earlier call finished, the engine parked the K/V of `earlier prompt + reply[:-1]` (the
positions it had computed) in a row of its park; the next call finds that row as the longest parked prefix of
the new prompt and computes only the rest. This index is host-side bookkeeping only: rows and token ids.

Lookup is by polynomial hashes of every prefix of the prompt (wrapping uint64 arithmetic, vectorised with
numpy), checked against the parked entries' hashes in one `isin`, the longest match verified token by token.
A row is given back when its entry is taken (the caller copies it out at once) or evicted (oldest first).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

_BASE = np.uint64(1_000_003)


class PrefixIndex:
    """Parked token prefixes -> park rows; `rows` rows, prefixes up to `max_len` tokens."""

    def __init__(self, rows: int, max_len: int):
        self._free = list(range(rows - 1, -1, -1))
        self._entries: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # hash -> (row, tokens)
        self._keys: np.ndarray | None = None  # the entries' hashes as an array, rebuilt after a change
        with np.errstate(over="ignore"):
            self._powers = np.cumprod(np.full(max_len, _BASE, dtype=np.uint64))

    def __len__(self) -> int:
        return len(self._entries)

    def _hashes(self, tokens: list[int]) -> np.ndarray:
        """Hash of every prefix: out[i] is the hash of tokens[: i + 1]."""
        t = np.asarray(tokens, dtype=np.uint64) + np.uint64(1)
        with np.errstate(over="ignore"):
            return np.cumsum(t * self._powers[: len(t)], dtype=np.uint64)

    def add(self, tokens: list[int]) -> int:
        """Park `tokens`: -> the row to copy their K/V into (the oldest entry's row when none is free)."""
        key = int(self._hashes(tokens)[-1])
        if key in self._entries:
            self._remove(key)
        if not self._free:
            self._remove(next(iter(self._entries)))
        row = self._free.pop()
        self._entries[key] = (row, tuple(tokens))
        self._keys = None
        return row

    def take(self, prompt: list[int]) -> tuple[int, int] | None:
        """The longest parked proper prefix of `prompt`: (row, length), removed from the index; None if none."""
        if not self._entries or len(prompt) < 2:
            return None
        if self._keys is None:
            self._keys = np.fromiter(self._entries, dtype=np.uint64, count=len(self._entries))
        hashes = self._hashes(prompt)[:-1]  # proper prefixes: at least one token is left to compute
        for length in np.flatnonzero(np.isin(hashes, self._keys))[::-1] + 1:
            key = int(hashes[length - 1])
            row, tokens = self._entries[key]
            if len(tokens) == length and tokens == tuple(prompt[:length]):
                self._remove(key)
                return row, int(length)
        return None

    def clear(self) -> None:
        for key in list(self._entries):
            self._remove(key)

    def _remove(self, key: int) -> None:
        row, _ = self._entries.pop(key)
        self._free.append(row)
        self._keys = None


class PrefixRouter:
    """Data-parallel generation with prefix reuse: which engine parked which sequence, so that a trajectory's next
    turn goes to the engine that holds its earlier turns' K/V. Prompts without a parked prefix fill the least
    loaded engines. The engines evict on their own; a prompt routed to an entry its engine has dropped is only
    recomputed there."""

    def __init__(self, engines: int, rows_per_engine: int, max_len: int):
        self.engines = engines
        self._index = PrefixIndex(engines * rows_per_engine, max_len)
        self._engine_of_row: dict[int, int] = {}

    def shards(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """Prompt indices per engine, each in increasing order."""
        shards: list[list[int]] = [[] for _ in range(self.engines)]
        unrouted = []
        for i, prompt in enumerate(prompt_ids):
            hit = self._index.take(prompt)
            (shards[self._engine_of_row[hit[0]]] if hit else unrouted).append(i)
        for i in unrouted:
            min(shards, key=len).append(i)
        return [sorted(shard) for shard in shards]

    def record(self, shards: list[list[int]], prompt_ids: list[list[int]], results: list[list]) -> None:
        """Each engine parked its prompts + outputs (all but the last token's K/V); results[g] are engine g's
        outputs, their prompt_index into shards[g]."""
        for engine, (rows, outputs) in enumerate(zip(shards, results)):
            for out in outputs:
                tokens = prompt_ids[rows[out.prompt_index]] + out.response_ids[:-1]
                self._engine_of_row[self._index.add(tokens)] = engine
