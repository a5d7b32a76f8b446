"""The rollout engine interface shared by every backend (hf, vllm).

Engines generate from token ids and return, per sample, the response ids, the sampled tokens' logprobs
and a finish reason. Outputs are prompt-major: the `n` samples of prompt i are consecutive.

Logprob convention (all engines and the trainer agree on it): the log-probability of the sampled token
under softmax(logits / temperature), before any top-k/top-p filtering; greedy decoding uses
temperature 1 for the logprob.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # same seed, same prompts, same weights -> same samples (None: engine's own)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature


@dataclass
class RolloutOutput:
    prompt_index: int
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token ended it; the token is kept) or "length"
    extra: dict = field(default_factory=dict)


class PackedOutputs(Sequence[RolloutOutput]):
    """A generate call's outputs as arrays: what workers send to the driver. Every response's token ids (int64) and
    logprobs (float64: the same Python floats come back) laid end to end, with the responses' lengths, prompt
    indices, finish reasons and extras. A list of RolloutOutput pickles one Python object per token (unpickling
    1,024 responses of ~300 tokens took 38 ms on one core, the driver's serial time); these pickle as a few buffers
    (3 ms). Indexing and iterating give RolloutOutput objects with lists, made once; `token_lists` and `split`
    give whole columns without them."""

    def __init__(self, prompt_index: np.ndarray, lengths: np.ndarray, token_ids: np.ndarray, logprobs: np.ndarray,
                 finish_reasons: list[str], extras: list[dict]):
        if not (len(prompt_index) == len(lengths) == len(finish_reasons) == len(extras)):
            raise ValueError("PackedOutputs: prompt_index, lengths, finish_reasons and extras differ in length")
        if not (len(token_ids) == len(logprobs) == int(lengths.sum())):
            raise ValueError("PackedOutputs: token_ids and logprobs must hold sum(lengths) values each")
        self.prompt_index, self.lengths = np.asarray(prompt_index, np.int64), np.asarray(lengths, np.int64)
        self.token_ids, self.logprobs = np.asarray(token_ids, np.int64), np.asarray(logprobs, np.float64)
        self.finish_reasons, self.extras = list(finish_reasons), list(extras)
        self._outputs: list[RolloutOutput] | None = None

    @classmethod
    def pack(cls, outputs: Sequence[RolloutOutput]) -> PackedOutputs:
        if isinstance(outputs, PackedOutputs):
            return outputs
        outputs = list(outputs)
        lengths = np.fromiter((len(o.response_ids) for o in outputs), np.int64, count=len(outputs))
        total = int(lengths.sum())
        packed = cls(np.fromiter((o.prompt_index for o in outputs), np.int64, count=len(outputs)), lengths,
                     np.fromiter(chain.from_iterable(o.response_ids for o in outputs), np.int64, count=total),
                     np.fromiter(chain.from_iterable(o.logprobs for o in outputs), np.float64, count=total),
                     [o.finish_reason for o in outputs], [o.extra for o in outputs])
        packed._outputs = outputs  # the given objects: what iterating in this process gives (not pickled)
        return packed

    @classmethod
    def concat(cls, parts: Sequence[Sequence[RolloutOutput]], prompt_rows: Sequence[Sequence[int]]) -> PackedOutputs:
        """Several calls' outputs as one; part i's prompt indices are positions in `prompt_rows[i]`, and become
        its values (the rows of the prompts in the whole call)."""
        packed = [cls.pack(part) for part in parts]
        if not packed:
            return cls.pack([])
        index = [np.asarray(rows, dtype=np.int64)[p.prompt_index] for p, rows in zip(packed, prompt_rows, strict=True)]
        columns = (np.concatenate([getattr(p, k) for p in packed]) for k in ("lengths", "token_ids", "logprobs"))
        return cls(np.concatenate(index), *columns, [f for p in packed for f in p.finish_reasons],
                   [e for p in packed for e in p.extras])

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i):
        return self._list()[i]

    def __iter__(self):
        return iter(self._list())

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_outputs": None}  # the arrays only

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """A flat column (`token_ids`, `logprobs`) cut into one array view per response."""
        return np.split(flat, np.cumsum(self.lengths)[:-1]) if len(self) else []

    def token_lists(self) -> list[list[int]]:
        if self._outputs is not None:
            return [o.response_ids for o in self._outputs]
        return [ids.tolist() for ids in self.split(self.token_ids)]

    def _list(self) -> list[RolloutOutput]:
        if self._outputs is None:
            ids, logprobs = ([x.tolist() for x in self.split(flat)] for flat in (self.token_ids, self.logprobs))
            self._outputs = [RolloutOutput(*row) for row in zip(
                self.prompt_index.tolist(), ids, logprobs, self.finish_reasons, self.extras)]
        return self._outputs


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[RolloutOutput]: ...

    def update_weights(self, state: dict[str, torch.Tensor]) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...
