"""Entropy and log-probs from logits (hand values, references, low precision); the clipped value loss."""

import math

import pytest
import torch

from stages.core import LOSS_AGG_MODES, clipped_value_loss, entropy_from_logits, logprobs_from_logits, loss_denominators

F64 = torch.float64
ATOL = 1e-9


def _close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_entropy_hand_values():
    # softmax([0, ln 3]) = [0.25, 0.75]: H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.56234; uniform over 4: ln 4
    logits = torch.tensor([[[0.0, math.log(3.0), -1e4, -1e4], [1.0, 1.0, 1.0, 1.0]]], dtype=F64)
    _close(entropy_from_logits(logits), [[-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(4.0)]])


def test_logprobs_hand_values():
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0]]], dtype=F64)
    labels = torch.tensor([[1, 0]])
    _close(logprobs_from_logits(logits, labels), [[math.log(0.75), math.log(0.5)]])


def test_match_torch_references_values_and_gradients():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 11, dtype=F64, generator=gen) * 4).requires_grad_(True)
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    ref_logits = logits.detach().clone().requires_grad_(True)

    entropy, logprobs = entropy_from_logits(logits), logprobs_from_logits(logits, labels)
    ref_entropy = torch.distributions.Categorical(logits=ref_logits).entropy()
    ref_logprobs = torch.log_softmax(ref_logits, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    _close(entropy, ref_entropy.detach(), atol=1e-12)
    _close(logprobs, ref_logprobs.detach(), atol=1e-12)
    (entropy.sum() + logprobs.sum()).backward()
    (ref_entropy.sum() + ref_logprobs.sum()).backward()
    _close(logits.grad, ref_logits.grad, atol=1e-12)


def test_extreme_logits_are_stable():
    logits = torch.tensor([[1e4, -1e4, 0.0]], dtype=torch.float32)
    assert entropy_from_logits(logits).abs().item() < 1e-6  # all mass on one token
    assert torch.isfinite(logprobs_from_logits(logits, torch.tensor([1]))).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_give_float32_of_the_rounded_logits(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 3, 50, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, 50, (2, 3), generator=gen)
    entropy, logprobs = entropy_from_logits(logits), logprobs_from_logits(logits, labels)
    assert entropy.dtype == logprobs.dtype == torch.float32
    _close(entropy, entropy_from_logits(logits.float()), atol=1e-5)
    _close(logprobs, logprobs_from_logits(logits.float(), labels), atol=1e-5)


def test_clipped_value_loss_hand_values():
    values = torch.tensor([[1.0, 2.0, 0.5, 77.0]], dtype=F64, requires_grad=True)  # 77 under the mask
    old = torch.tensor([[1.2, 1.0, 0.5, 0.0]], dtype=F64)
    returns = torch.tensor([[1.1, 3.0, 0.0, -5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, metrics = clipped_value_loss(values, old, returns, mask, cliprange_value=0.2)
    # t0: v in [1.0, 1.4] -> both (1 - 1.1)^2 = 0.01       t1: v_clip = 1.2: max((2-3)^2, (1.2-3)^2) = 3.24 (clipped)
    # t2: v_clip = 0.5 = v: 0.25                           loss = 0.5 * (0.01 + 3.24 + 0.25) / 3 = 0.58333
    _close(loss, 0.5 * 3.5 / 3)
    _close(metrics["critic/vf_clipfrac"], 1 / 3)
    _close(metrics["critic/vpred_mean"], 3.5 / 3)
    loss.backward()
    # t0: (v - R) / 3 = -0.1 / 3; t1: the clipped term wins and does not depend on v -> 0; t2: (0.5 - 0) / 3
    _close(values.grad, [[-0.1 / 3, 0.0, 0.5 / 3, 0.0]])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_micro_batches_and_mask(mode):
    gen = torch.Generator().manual_seed(2)
    values, old, returns = (torch.randn(6, 4, dtype=F64, generator=gen) for _ in range(3))
    mask = torch.arange(4)[None, :] < torch.tensor([4, 1, 3, 2, 4, 3])[:, None]
    full_leaf = values.clone().requires_grad_(True)
    full, _ = clipped_value_loss(full_leaf, old, returns, mask, 0.5, mode)
    full.backward()

    leaf = torch.where(mask, values, 1e6).requires_grad_(True)  # garbage under the mask too
    denominators = loss_denominators(mask) | {"max_response_length": 4}
    total = sum(clipped_value_loss(leaf[i : i + 3], old[i : i + 3], returns[i : i + 3], mask[i : i + 3], 0.5, mode,
                                   **denominators)[0] for i in (0, 3))  # fmt: skip
    total.backward()
    _close(total, full, atol=1e-12)
    _close(leaf.grad, full_leaf.grad, atol=1e-12)
