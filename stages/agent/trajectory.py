"""One sample's trajectory, as the trainer, the reward and the tables see it.

Token in, token out: `response_ids` are the engine's own token ids for the model's turns, never decoded and
re-encoded; only tool and user messages are tokenized (with the chat template) and appended. `response_mask`
is 1 on the model's tokens and 0 on the appended ones; `logprobs` holds the engine's logprob on the model's
tokens and 0 elsewhere. A single-turn trajectory is one model turn: mask all ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Trajectory:
    prompt_index: int  # index into the prompt rows the rollout was given
    response_ids: list[int] | np.ndarray  # single-turn: a 1-D array view of the packed outputs (stages/rollout/base.py)
    response_mask: list[int]  # 1: the model's token, 0: a tool or user token
    logprobs: list[float] | np.ndarray  # the engine's logprob of each model token, 0.0 on tool/user tokens
    finish_reason: str  # "stop", "length", or a loop's own reason (e.g. "max_turns")
    text: str  # what the reward scores: the model's decoded text (all turns' for multi-turn loops)
    agent_name: str = "single_turn"
    turns: list[dict] = field(default_factory=list)  # multi-turn: one record per turn (the `turns` table)
    tool_reward: float = 0.0  # the sum of the tools' step rewards and calc_reward, times tool_reward_weight
    metrics: dict[str, float] = field(default_factory=dict)  # per-sample counts (tool calls, errors, ...)
    interaction_reward: float = 0.0  # a simulated user's turn scores, summed, times interaction_reward_weight
    versions: list[int] | None = None  # asynchronous modes: each token's policy version (-1 on tool/user tokens)

    def __post_init__(self):
        if not (len(self.response_ids) == len(self.response_mask) == len(self.logprobs)):
            raise ValueError(f"trajectory of prompt {self.prompt_index}: {len(self.response_ids)} ids, "
                             f"{len(self.response_mask)} mask values and {len(self.logprobs)} logprobs differ")

    @property
    def num_turns(self) -> int:
        return max(1, sum(1 for t in self.turns if t.get("role") == "assistant"))
