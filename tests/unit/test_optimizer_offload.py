"""OffloadedAdamW (rl.actor.optimizer_offload): the same steps as AdamW, moments emptied between steps."""

import torch

from infra.trainer_config import OptimConfig
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


def test_fsdp2_shards_in_host_memory_step_with_the_fused_kernel_as_the_loop_does(monkeypatch):
    """Parameters offloaded by FSDP2 from a GPU (DTensors whose shards are on the CPU) get the fused AdamW kernel;
    its steps equal the default loop's. (CUDA is pretended: FSDP2's offload itself needs a GPU.)"""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from stages.model.fsdp import init_process_group

    created = not dist.is_initialized()
    init_process_group()  # a world of this process (FSDP2 needs one)
    try:
        torch.manual_seed(0)
        base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        results = {}
        for cuda in (False, True):
            monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
            model = copy.deepcopy(base)
            fully_shard(model[0])
            fully_shard(model)
            optimizer = build_optimizer(model.parameters(), OptimConfig(lr=0.01, weight_decay=0.1))
            assert optimizer.defaults["fused"] is (True if cuda else None)
            for step in range(3):
                model(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            results[cuda] = [p.full_tensor() for p in model.parameters()]
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(*results.values()))
    finally:
        if created:
            dist.destroy_process_group()
