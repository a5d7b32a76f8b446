"""The rollout engine interface shared by every backend (hf, vllm).

Engines generate from token ids and return, per sample, the response ids, the sampled tokens' logprobs
and a finish reason. Outputs are prompt-major: the `n` samples of prompt i are consecutive.

Logprob convention (all engines and the trainer agree on it): the log-probability of the sampled token
under softmax(logits / temperature), before any top-k/top-p filtering; greedy decoding uses
temperature 1 for the logprob.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

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


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[RolloutOutput]: ...

    def update_weights(self, state: dict[str, torch.Tensor]) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...
