"""KL estimators, straight-through variants, KL in the reward, KL as a loss, KL controllers."""

import math

import pytest
import torch

from stages.core import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_loss,
    kl_penalty,
    loss_denominators,
    make_kl_controller,
)

F64 = torch.float64
ATOL = 1e-9

# d = log pi - log pi_ref = 0.5, -1.0
LOGPROBS = torch.tensor([-1.0, -2.0], dtype=F64)
REF = torch.tensor([-1.5, -1.0], dtype=F64)


def _close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0)


@pytest.mark.parametrize(
    "kl_type, expected",
    [
        ("k1", [0.5, -1.0]),
        ("kl", [0.5, -1.0]),
        ("abs", [0.5, 1.0]),
        ("k2", [0.125, 0.5]),  # d^2 / 2
        ("mse", [0.125, 0.5]),
        # ref - logp = -0.5, 1.0: exp(-0.5) + 0.5 - 1 = 0.10653; exp(1) - 1 - 1 = 0.71828
        ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0]),
        ("low_var_kl", [math.exp(-0.5) - 0.5, math.e - 2.0]),
    ],
)
def test_kl_estimators_hand_values(kl_type, expected):
    _close(kl_penalty(LOGPROBS, REF, kl_type), expected)


def test_k3_clamps():
    # ref - logp = 30 -> clamped to 20 -> exp(20) - 21 ~ 4.9e8 -> clamped to 10; ref - logp = -30 -> e^-20 + 19 -> 10
    _close(kl_penalty(torch.tensor([-31.0, -1.0], dtype=F64), torch.tensor([-1.0, -31.0], dtype=F64), "k3"), [10, 10])


@pytest.mark.parametrize("base", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_straight_through_variants(base):
    """`<key>+`: the value of <key>, the gradient of k2 (which is d = log pi - log pi_ref)."""
    leaf = LOGPROBS.clone().requires_grad_(True)
    value = kl_penalty(leaf, REF, base + "+")
    _close(value, kl_penalty(LOGPROBS, REF, base))
    value.sum().backward()
    _close(leaf.grad, [0.5, -1.0])


def test_unknown_kl_type():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; valid keys: k1, k1\+, kl"):
        kl_penalty(LOGPROBS, REF, "k4")


def test_apply_kl_penalty_hand_values():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=F64)
    ref = torch.zeros(2, 3, dtype=F64)
    old = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]], dtype=F64)  # 9 is under the mask
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kl_type="k1")
    # rewards = scores - 0.1 * kl on valid tokens; the masked token keeps its score (0)
    _close(rewards, [[-0.01, -0.02, 0.97], [-0.04, 0.95, 0.0]])
    _close(metrics["actor/reward_kl_penalty"], (0.2 + 0.45) / 2)  # per-sequence means 0.2, 0.45 -> 0.325
    _close(metrics["actor/reward_kl_penalty_coeff"], 0.1)


def test_kl_loss_hand_values_and_mask():
    logprobs = torch.tensor([[-1.0, -2.0, 1e6]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -1e6]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    loss, metrics = kl_loss(logprobs, ref, mask, "k2")
    _close(loss, (0.125 + 0.5) / 2)
    _close(metrics["actor/kl_loss"], 0.3125)
    loss.backward()
    _close(logprobs.grad, [[0.25, -0.5, 0.0]])  # d / 2 tokens; nothing from the masked one


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_kl_loss_micro_batches(mode):
    gen = torch.Generator().manual_seed(0)
    logprobs, ref = -torch.rand(5, 4, dtype=F64, generator=gen), -torch.rand(5, 4, dtype=F64, generator=gen)
    mask = torch.arange(4)[None, :] < torch.tensor([4, 1, 3, 2, 4])[:, None]
    full, _ = kl_loss(logprobs, ref, mask, "low_var_kl", mode)
    denominators = loss_denominators(mask) | {"max_response_length": 4}
    total = sum(kl_loss(logprobs[i : i + 2], ref[i : i + 2], mask[i : i + 2], "low_var_kl", mode, **denominators)[0]
                for i in (0, 2, 4))  # fmt: skip
    _close(total, full, atol=1e-12)


def test_adaptive_controller_hand_arithmetic():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=1000)
    ctl.update(current_kl=0.06, n_steps=100)  # e = 0.06 / 0.05 - 1 = 0.2 -> x (1 + 0.2 * 100 / 1000) = 1.02
    assert ctl.value == pytest.approx(0.102, abs=1e-12)
    ctl.update(current_kl=0.5, n_steps=100)  # e = 9 -> clipped to 0.2 -> x 1.02
    assert ctl.value == pytest.approx(0.10404, abs=1e-12)
    ctl.update(current_kl=0.0, n_steps=500)  # e = -1 -> clipped to -0.2 -> x (1 - 0.2 * 0.5) = 0.9
    assert ctl.value == pytest.approx(0.093636, abs=1e-12)
    ctl.update(current_kl=0.0475, n_steps=1000)  # e = -0.05 -> x 0.95
    assert ctl.value == pytest.approx(0.0889542, abs=1e-12)


def test_controllers_state_dict_roundtrip():
    ctl = AdaptiveKLController(0.1, 0.05, 1000)
    ctl.update(0.06, 100)
    restored = AdaptiveKLController(0.1, 0.05, 1000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value == pytest.approx(0.102)
    restored.update(0.06, 100)
    ctl.update(0.06, 100)
    assert restored.value == ctl.value

    fixed = FixedKLController(0.2)
    fixed.update(1.0, 100)  # no-op
    assert fixed.value == 0.2 and fixed.state_dict() == {"value": 0.2}
    other = FixedKLController(0.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.2


def test_controller_factory_and_validation():
    assert isinstance(make_kl_controller("fixed", 0.1), FixedKLController)
    assert make_kl_controller("adaptive", 0.1, target_kl=0.1, horizon=10).horizon == 10
    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="kind='pid' is not supported"):
        make_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="horizon=0 must both be > 0"):
        AdaptiveKLController(0.1, 0.05, 0)
    with pytest.raises(ValueError, match="kl_coef=-1 must be >= 0"):
        FixedKLController(-1)


def test_registry_entries_accept_two_tensors():
    for key in KL_ESTIMATORS.keys():
        assert KL_ESTIMATORS.get(key)(LOGPROBS, REF).shape == LOGPROBS.shape
