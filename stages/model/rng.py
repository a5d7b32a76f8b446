"""The random generators a training process draws from (dropout), saved with its checkpoints so that a resumed run
continues the same streams: the CPU generator, and the current CUDA device's where CUDA is in use (dropout on a GPU
draws from that one; saving the CPU generator alone made a resumed GPU run repeat step 0's dropout masks)."""

from __future__ import annotations

import torch


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor] | torch.Tensor) -> None:
    """Restore `rng_state()`'s generators; a bare tensor is a checkpoint's CPU generator from before the CUDA one was
    saved too."""
    if isinstance(state, torch.Tensor):
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
