"""One RL step's samples: per-sample lists, and the padded tensors the workers compute on.

Rows are samples (prompt x n). Tensors follow verl's layout: a left-padded prompt of P tokens followed
by a right-padded response of R tokens (see stages/model/policy.py). Tensors computed later in the step
(old/ref logprobs, values, rewards, advantages) are added to `tensors` under their verl names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.tensors["input_ids"].shape[0]

    @property
    def num_response_tokens(self) -> int:
        return self.tensors["response_mask"].shape[1]

    @property
    def response_mask(self) -> torch.Tensor:
        return self.tensors["response_mask"]

    def select(self, rows: list[int] | torch.Tensor) -> Batch:
        index = torch.as_tensor(rows, dtype=torch.long)
        tensors = {k: v.index_select(0, index) for k, v in self.tensors.items()}
        meta = {k: [v[i] for i in index.tolist()] for k, v in self.meta.items()}
        return Batch(tensors, meta)

    def model_inputs(self) -> dict:
        """What TokenLogprobs / ValueModel take (on CPU; the worker moves them)."""
        t = self.tensors
        return {"input_ids": t["input_ids"], "attention_mask": t["attention_mask"],
                "position_ids": t["position_ids"], "num_response_tokens": self.num_response_tokens}


def build_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], rollout_logprobs: list[list[float]],
                pad_token_id: int, meta: dict[str, list] | None = None) -> Batch:
    """Pad samples into verl's layout. Every response must have at least one token."""
    if any(len(r) == 0 for r in response_ids):
        raise ValueError("every response needs at least one token (max_tokens >= 1)")
    n = len(prompt_ids)
    p = max(len(x) for x in prompt_ids)
    r = max(len(x) for x in response_ids)
    input_ids = torch.full((n, p + r), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, p + r), dtype=torch.long)
    logprobs = torch.zeros((n, r), dtype=torch.float32)
    for i, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[i, p - len(prompt) : p] = torch.tensor(prompt)
        input_ids[i, p : p + len(response)] = torch.tensor(response)
        attention_mask[i, p - len(prompt) : p + len(response)] = 1
        logprobs[i, : len(response)] = torch.tensor(rollout_logprobs[i], dtype=torch.float32)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention_mask[:, p:].bool()
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
               "response_mask": response_mask, "rollout_logprobs": logprobs}
    return Batch(tensors, dict(meta or {}))


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence scores placed on each sequence's last response token -> (B, R)."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = response_mask.long().sum(-1) - 1  # (B,)
    out[torch.arange(len(scores)), last] = scores.float()
    return out

