"""OffloadedAdamW (rl.actor.optimizer_offload): the same steps as AdamW, moments emptied between steps."""

import torch

from infra.config import OptimConfig
from stages.model.optim import OffloadedAdamW, build_optimizer


def _train(offload: bool, steps: int = 3, resume_at: int | None = None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    optimizer = build_optimizer(model.parameters(), OptimConfig(lr=0.05), offload_state=offload)
    for step in range(steps):
        if step == resume_at:  # a checkpoint's state_dict into a new optimizer: training goes on identically
            saved = optimizer.state_dict()
            optimizer = build_optimizer(model.parameters(), OptimConfig(lr=0.05), offload_state=offload)
            optimizer.load_state_dict(saved)
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _moments(optimizer):
    return [v for state in optimizer.state.values() for k, v in state.items() if k.startswith("exp_avg")]


def test_offloaded_state_gives_the_same_steps_and_frees_the_moments():
    plain, _ = _train(offload=False)
    offloaded, optimizer = _train(offload=True)
    assert isinstance(optimizer, OffloadedAdamW)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), offloaded.parameters()))
    assert len(_moments(optimizer)) == 8 and all(m.untyped_storage().nbytes() == 0 for m in _moments(optimizer))


def test_state_dict_brings_the_moments_back_and_resuming_is_exact():
    plain, _ = _train(offload=False, steps=4)
    resumed, optimizer = _train(offload=True, steps=4, resume_at=2)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), resumed.parameters()))
    state = optimizer.state_dict()["state"]
    assert all(v.untyped_storage().nbytes() > 0 for s in state.values() for k, v in s.items() if k != "step")
    optimizer.offload()  # what TrainEngine.save does after writing the checkpoint; twice is harmless
    optimizer.offload()
    assert all(m.untyped_storage().nbytes() == 0 for m in _moments(optimizer))
