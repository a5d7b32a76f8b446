"""The `cuda` engine's per-sequence state (cuda_engine.py): slots on the device, the batch sizes its decode graphs
are captured for, and the cut of a finished slot's output at its first stop token."""

from __future__ import annotations

import torch

from stages.rollout.base import RolloutOutput

MAX_STOP_TOKENS = 8


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 32, then every 16: under 16 padding rows, under 12% from 128 rows on."""
    sizes = [1, 2, 4, 8, 16, 24, 32, *range(48, max_num_seqs + 16, 16)]
    return sorted({min(s, max_num_seqs) for s in sizes})


class Slots:
    """Per-slot state on the device (fixed addresses: the captured graphs read and write them)."""

    def __init__(self, num_slots: int, width: int, device: torch.device):
        kw = {"device": device, "dtype": torch.long}
        self.token = torch.zeros(num_slots, **kw)
        self.pos = torch.zeros(num_slots, **kw)
        self.gen = torch.zeros(num_slots, **kw)
        self.done = torch.ones(num_slots, device=device, dtype=torch.bool)
        self.out_tokens = torch.zeros(num_slots, width, **kw)
        self.out_logprobs = torch.zeros(num_slots, width, device=device)
        self.stop_ids = torch.full((MAX_STOP_TOKENS,), -1, **kw)
        self.limit = torch.zeros(num_slots, **kw)  # tokens a slot may generate: max_tokens, or less near max_model_len
        self.rows = torch.arange(num_slots, device=device)

    def rows_state(self) -> tuple[torch.Tensor, ...]:
        return self.token, self.pos, self.gen, self.done, self.limit, self.out_tokens, self.out_logprobs

    def reset_from(self, start: int) -> None:
        """Free slots: position 0, nothing generated, done (their padding-row writes stay in range)."""
        for t, value in ((self.token, 0), (self.pos, 0), (self.gen, 0), (self.done, True)):
            t[start:].fill_(value)


def trim(tokens: list[int], logprobs: list[float], stops: set[int], prompt_index: int) -> RolloutOutput:
    """A finished slot's output, cut after its first stop token (finish reason 'stop'), else whole ('length')."""
    end = next((i for i, t in enumerate(tokens) if t in stops), None)
    if end is None:
        return RolloutOutput(prompt_index, tokens, logprobs, "length")
    return RolloutOutput(prompt_index, tokens[: end + 1], logprobs[: end + 1], "stop")
