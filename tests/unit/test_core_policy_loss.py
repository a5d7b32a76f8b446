"""Policy losses: hand values and gradients, mask invariance, micro-batch invariance, the call convention."""

import math

import pytest
import torch

from stages.core import LOSS_AGG_MODES, POLICY_LOSSES, cov_losses, loss_denominators, policy_loss

F64 = torch.float64
ATOL = 1e-9
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}


def _t(rows):
    return torch.tensor(rows, dtype=F64)


def _close(actual, expected, atol=ATOL):
    expected = torch.as_tensor(expected, dtype=F64)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def _leaf(rows):
    return _t(rows).requires_grad_(True)


def test_vanilla_hand_values():
    # ratios r = 1.5, 0.5, 0.5, 4 with A = +1, +1, -1, -1; eps_lo 0.2, eps_hi 0.28, c = 3
    ratios, adv = [1.5, 0.5, 0.5, 4.0], _t([[1.0, 1.0, -1.0, -1.0]])
    logprobs = _leaf([[-1.0, -2.0, -0.5, -1.5]])
    old = logprobs.detach() - torch.log(_t([ratios]))
    loss, m = policy_loss.vanilla_policy_loss(old, logprobs, adv, torch.ones(1, 4, dtype=torch.bool), **CLIP)
    # t0: max(-1.5, -1.28) = -1.28 (clipped)    t1: max(-0.5, -0.8) = -0.5
    # t2: max(0.5, 0.8) = 0.8 (clipped), dual bound 3 not hit    t3: max(4, 1.28) = 4 -> min(4, 3) = 3 (dual clip)
    _close(loss, (-1.28 - 0.5 + 0.8 + 3.0) / 4)  # 0.505
    _close(m["actor/pg_clipfrac"], 2 / 4)  # t0, t2
    _close(m["actor/pg_clipfrac_lower"], 1 / 4)  # t3
    _close(m["actor/ppo_kl"], -sum(math.log(r) for r in ratios) / 4)  # mean(old - new) = -0.10137
    loss.backward()
    # only t1 is unclipped: d(-A r)/d log pi = -A r = -0.5, / 4 tokens
    _close(logprobs.grad, [[0.0, -0.125, 0.0, 0.0]])


def test_vanilla_rejects_bad_dual_clip():
    z = torch.zeros(1, 2, dtype=F64)
    with pytest.raises(ValueError, match="clip_ratio_c=1.0: the dual-clip bound must be > 1"):
        policy_loss.vanilla_policy_loss(z, z, z, z.bool(), **CLIP, clip_ratio_c=1.0)


def test_gspo_hand_values():
    # seq0: log r = 0.1, 0.3 -> s = exp(0.2) = 1.2214, A = +1 -> clipped at 1.1: -1.1 per token
    # seq1: log r = -0.05 -> s = exp(-0.05) = 0.95123 inside [0.9, 1.1], A = -1 -> 0.95123 (second token masked)
    logprobs = _leaf([[-1.0, -2.0], [-0.5, -7.0]])
    old = logprobs.detach() - _t([[0.1, 0.3], [-0.05, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    adv = _t([[1.0, 1.0], [-1.0, -1.0]])
    loss, m = policy_loss.gspo_policy_loss(old, logprobs, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.1)
    s1 = math.exp(-0.05)
    _close(loss, (-1.1 + s1) / 2)  # seq-mean-token-mean: (mean(-1.1, -1.1) + 0.95123) / 2 = -0.07438
    _close(m["actor/pg_clipfrac"], 2 / 3)
    _close(m["actor/ppo_kl"], -(0.1 + 0.3 - 0.05) / 3)
    loss.backward()
    # seq1's token: d(-A s_t)/d log pi = -A * s = 0.95123, weighted 1 / (1 token * 2 seqs); seq0 clipped -> 0
    _close(logprobs.grad, [[0.0, 0.0], [s1 / 2, 0.0]])


def test_gspo_ratio_is_per_sequence():
    """Two tokens with opposite log-ratios have sequence ratio 1: nothing is clipped, loss = -A."""
    logprobs = _leaf([[-1.0, -2.0]])
    old = logprobs.detach() - _t([[0.5, -0.5]])
    loss, m = policy_loss.gspo_policy_loss(old, logprobs, _t([[2.0, 2.0]]), torch.ones(1, 2, dtype=torch.bool),
                                           clip_ratio_low=3e-4, clip_ratio_high=4e-4)  # fmt: skip
    _close(loss, -2.0)
    _close(m["actor/pg_clipfrac"], 0.0)


def test_gpg_hand_values():
    logprobs = _leaf([[-1.0, -2.0]])
    loss, m = policy_loss.gpg_policy_loss(logprobs.detach(), logprobs, _t([[0.5, -1.0]]),
                                          torch.ones(1, 2, dtype=torch.bool), **CLIP)  # fmt: skip
    _close(loss, -(0.5 * -1.0 + -1.0 * -2.0) / 2)  # -(-0.5 + 2) / 2 = -0.75
    loss.backward()
    _close(logprobs.grad, [[-0.25, 0.5]])  # -A / 2
    _close(m["actor/pg_clipfrac"], 0.0)


def test_cispo_hand_values():
    # r = 1.5, 0.5, 1.0 -> detached weights clip(r, 0.8, 1.28) = 1.28, 0.8, 1.0; A = 1, -1, 2
    logprobs = _leaf([[-1.0, -2.0, -0.5]])
    old = logprobs.detach() - torch.log(_t([[1.5, 0.5, 1.0]]))
    adv = _t([[1.0, -1.0, 2.0]])
    loss, m = policy_loss.cispo_policy_loss(old, logprobs, adv, torch.ones(1, 3, dtype=torch.bool), **CLIP)
    # -w A log pi: -1.28*1*(-1) = 1.28; -0.8*(-1)*(-2) = -1.6; -1*2*(-0.5) = 1.0 -> mean 0.68 / 3
    _close(loss, 0.68 / 3)
    _close(m["actor/pg_clipfrac"], 2 / 3)
    loss.backward()
    _close(logprobs.grad, [[-1.28 / 3, 0.8 / 3, -2.0 / 3]])  # -w A / 3: every token keeps a gradient


# clip_cov / kl_cov: A = 2, 0, 0, 0.4 (mean 0.6) and log pi = 0, -1, -1, -2 (mean -1) give
# cov = (A - 0.6) * (log pi + 1) = 1.4*1, -0.6*0, -0.6*0, -0.2*-1 = 1.4, 0, 0, 0.2: only t0 lies in (1, 5).
COV_LOGPROBS = [[0.0, -1.0, -1.0, -2.0]]
COV_ADV = _t([[2.0, 0.0, 0.0, 0.4]])
ALL4 = torch.ones(1, 4, dtype=torch.bool)


def test_clip_cov_detaches_high_covariance_token():
    logprobs = _leaf(COV_LOGPROBS)
    loss, m = cov_losses.clip_cov_policy_loss(logprobs.detach(), logprobs, COV_ADV, ALL4, **CLIP)
    # r = 1 everywhere: per-token -A = -2, 0, 0, -0.4; t0 detached (x 0) -> -0.4 / 4
    _close(loss, -0.1)
    _close(m["actor/pg_clipfrac"], 1 / 4)
    loss.backward()
    _close(logprobs.grad, [[0.0, 0.0, 0.0, -0.1]])
    # no candidate within (10, 20): plain PPO-clip, (-2 - 0.4) / 4
    loss, _ = cov_losses.clip_cov_policy_loss(logprobs.detach(), logprobs, COV_ADV, ALL4, **CLIP, clip_cov_lb=10.0,
                                              clip_cov_ub=20.0)  # fmt: skip
    _close(loss, -0.6)


def test_clip_cov_skips_tokens_already_clipped_by_ppo():
    logprobs = _leaf(COV_LOGPROBS)
    old = logprobs.detach() - torch.log(_t([[1.5, 1.0, 1.0, 1.0]]))  # t0: r = 1.5, A > 0 -> PPO-clipped at 1.28
    loss, m = cov_losses.clip_cov_policy_loss(old, logprobs, COV_ADV, ALL4, **CLIP)
    _close(loss, (-2 * 1.28 - 0.4) / 4)  # t0 keeps its clipped loss; nothing detached
    _close(m["actor/pg_clipfrac"], 0.0)


def test_clip_cov_picks_ratio_share_at_random_reproducibly():
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(8, 50, dtype=F64, generator=gen)
    logprobs = adv * 2.0  # perfectly correlated: many tokens with cov in (1, 5)
    mask = torch.ones(8, 50, dtype=torch.bool)
    cov = cov_losses.logprob_advantage_cov(logprobs, adv, mask)
    assert ((cov > 1) & (cov < 5)).sum() > 20  # many candidates, so the draw matters
    results = []
    for seed in (1, 1, 2):
        results.append(cov_losses.clip_cov_policy_loss(logprobs, logprobs, adv, mask, **CLIP, clip_cov_ratio=0.01,
                                                       generator=torch.Generator().manual_seed(seed)))  # fmt: skip
    (loss_a, m_a), (loss_b, _), (loss_c, m_c) = results
    _close(m_a["actor/pg_clipfrac"], 4 / 400)  # floor(0.01 * 400) = 4 tokens detached
    _close(m_c["actor/pg_clipfrac"], 4 / 400)
    assert torch.equal(loss_a, loss_b) and not torch.equal(loss_a, loss_c)  # same seed, same tokens
    with pytest.raises(ValueError, match="clip_cov_ratio=0 must be > 0"):
        cov_losses.clip_cov_policy_loss(logprobs, logprobs, adv, mask, **CLIP, clip_cov_ratio=0)


def test_kl_cov_hand_values():
    logprobs = _leaf(COV_LOGPROBS)
    log_r = [0.1, 0.2, -0.1, 0.0]
    old = logprobs.detach() - _t([log_r])
    loss, m = cov_losses.kl_cov_policy_loss(old, logprobs, COV_ADV, ALL4, **CLIP)  # ppo_kl_coef 0.1 (verl's)
    # k = max(1, floor(0.0002 * 4)) = 1 -> top cov is t0: -2 e^0.1 + 0.1 * |0.1|; others -A r = 0, 0, -0.4
    _close(loss, (-2 * math.exp(0.1) + 0.01 - 0.4) / 4)  # -0.65009
    _close(m["actor/pg_clipfrac"], 1 / 4)
    _close(m["actor/ppo_kl_abs"], 0.4 / 4)
    _close(m["actor/ppo_kl"], -0.2 / 4)
    loss.backward()
    # t0: d/d log pi (-A r + 0.1 |log r|) = -2 e^0.1 + 0.1; t3: -0.4; each / 4
    _close(logprobs.grad, [[(-2 * math.exp(0.1) + 0.1) / 4, 0.0, 0.0, -0.1]])
    weighted, _ = cov_losses.kl_cov_policy_loss(old, logprobs, COV_ADV, ALL4, **CLIP, ppo_kl_coef=1.0)
    _close(weighted, (-2 * math.exp(0.1) + 0.1 - 0.4) / 4)


# ---- Invariances ---------------------------------------------------------------------------------------------


def _random_batch(seed, batch=6, length=5):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, dtype=F64, generator=gen) * 3
    logprobs = old + 0.3 * torch.randn(batch, length, dtype=F64, generator=gen)  # some ratios get clipped
    adv = torch.randn(batch, length, dtype=F64, generator=gen)
    lengths = torch.tensor([5, 2, 3, 1, 4, 5])[:batch]
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return old, logprobs, adv, mask


def _loss_and_grad(name, old, logprobs, adv, mask, mode, **kwargs):
    leaf = logprobs.clone().requires_grad_(True)
    extra = {"generator": torch.Generator().manual_seed(0)} if name == "clip_cov" else {}
    loss, metrics = POLICY_LOSSES.get(name)(old, leaf, adv, mask, mode, **CLIP, **kwargs, **extra)
    loss.backward()
    return loss, leaf.grad, metrics


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", POLICY_LOSSES.keys())
def test_values_under_mask_do_not_matter(name, mode):
    old, logprobs, adv, mask = _random_batch(0)
    loss, grad, metrics = _loss_and_grad(name, old, logprobs, adv, mask, mode)
    garbage = torch.full_like(old, 1e6)
    dirty = [torch.where(mask, x, g) for x, g in ((old, -garbage), (logprobs, garbage), (adv, garbage))]
    dirty_loss, dirty_grad, dirty_metrics = _loss_and_grad(name, *dirty, mask, mode)
    torch.testing.assert_close(dirty_loss, loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(dirty_grad, grad, atol=1e-12, rtol=0)
    assert (dirty_grad[~mask] == 0).all()
    for key in metrics:
        torch.testing.assert_close(dirty_metrics[key], metrics[key], atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ["vanilla", "gspo", "gpg", "cispo"])
def test_micro_batches_give_full_batch_loss_and_gradient(name, mode):
    old, logprobs, adv, mask = _random_batch(1)
    full_loss, full_grad, _ = _loss_and_grad(name, old, logprobs, adv, mask, mode)

    leaf = logprobs.clone().requires_grad_(True)
    denominators = loss_denominators(mask) | {"max_response_length": mask.shape[-1]}
    total = 0.0
    for idx in (slice(0, 1), slice(1, 4), slice(4, 6)):  # uneven micro-batches 1 + 3 + 2
        loss, _ = POLICY_LOSSES.get(name)(old[idx], leaf[idx], adv[idx], mask[idx], mode, **CLIP, **denominators)
        total = total + loss
    total.backward()
    torch.testing.assert_close(total, full_loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(leaf.grad, full_grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", POLICY_LOSSES.keys())
def test_call_convention_metrics_and_no_mutation(name):
    old, logprobs, adv, mask = _random_batch(2)
    before = [t.clone() for t in (old, logprobs, adv, mask)]
    common = {"clip_ratio_c": 3.0, "global_num_tokens": None, "global_num_seqs": None, "max_response_length": None}
    loss, _, metrics = _loss_and_grad(name, old, logprobs, adv, mask, "token-mean", **common)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"} <= set(metrics)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    for t, b in zip((old, logprobs, adv, mask), before):
        assert torch.equal(t, b)


def test_on_policy_losses_agree_at_ratio_one():
    """At r = 1 with no clipping, vanilla, cispo and gpg have the same gradient -A / N."""
    old, _, adv, mask = _random_batch(3)
    grads = [_loss_and_grad(name, old, old, adv, mask, "token-mean")[1] for name in ("vanilla", "cispo", "gpg")]
    expected = torch.where(mask, -adv, 0.0) / mask.sum()
    for grad in grads:
        torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
