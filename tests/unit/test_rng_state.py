"""Generator states in checkpoints (stages/model/rng.py)."""

from __future__ import annotations

import torch

from stages.model.rng import rng_state, set_rng_state


def test_a_saved_state_replays_the_same_draws_and_old_checkpoints_still_load():
    torch.manual_seed(3)
    state, legacy = rng_state(), torch.get_rng_state()  # legacy: what SFT checkpoints held before (CPU only)
    first = torch.rand(4)
    set_rng_state(state)
    assert torch.equal(torch.rand(4), first)
    set_rng_state(legacy)
    assert torch.equal(torch.rand(4), first)
