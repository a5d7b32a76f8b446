"""clipped_step: clip, step unless the gradient norm is not finite, with and without a host wait."""

import pytest
import torch

from stages.model.optim import clipped_step


def _model_and_grads(fused: bool, bad: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused or None)
    loss = model(torch.randn(5, 4)).pow(2).sum() * (float("nan") if bad else 1.0)
    loss.backward()
    return model, optimizer


@pytest.mark.parametrize("fused", [False, True], ids=["host-check", "found_inf"])
def test_finite_gradients_are_clipped_and_stepped(fused):
    model, optimizer = _model_and_grads(fused, bad=False)
    before = [p.detach().clone() for p in model.parameters()]
    norm, skipped = clipped_step(model, optimizer, max_norm=0.5)
    assert float(norm) > 0.5 and float(skipped) == 0.0
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert not hasattr(optimizer, "found_inf")  # the protocol's attributes are removed again


@pytest.mark.parametrize("fused", [False, True], ids=["host-check", "found_inf"])
def test_non_finite_gradients_skip_the_step(fused):
    model, optimizer = _model_and_grads(fused, bad=True)
    before = [p.detach().clone() for p in model.parameters()]
    norm, skipped = clipped_step(model, optimizer, max_norm=1.0)
    assert not torch.isfinite(norm) and float(skipped) == 1.0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    steps = [float(s["step"]) for s in optimizer.state.values()]
    assert steps in ([], [0.0, 0.0])  # Adam's step count did not advance (bias correction stays right)
