"""Advantage estimators: hand values, verl's edge cases, a naive per-group reference, mask invariance."""

import math
import statistics

import numpy as np
import pytest
import torch

from stages.core import ADV_ESTIMATORS, AdvantageInputs, compute_advantages
from stages.core import advantages as adv

F64 = torch.float64
ATOL = 1e-9


def _t(rows):
    return torch.tensor(rows, dtype=F64)


def _m(rows):
    return torch.tensor(rows, dtype=torch.bool)


def _close(actual, expected):
    torch.testing.assert_close(actual, _t(expected) if isinstance(expected, list) else expected, atol=ATOL, rtol=0)


# Outcome batch: 4 sequences (T = 3) of valid lengths 3, 2, 1, 3; scores 1, 0, 1, 0.5 on the last valid token.
# Groups: "a" = {seq0: 1, seq1: 0}, "b" = {seq2: 1, seq3: 0.5}.
MASK = _m([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
REWARDS = _t([[0, 0, 1.0], [0, 0, 0], [1.0, 0, 0], [0, 0, 0.5]])
INDEX = ["a", "a", "b", "b"]


def _per_seq(values):
    """Broadcast per-sequence advantages over MASK's valid tokens, as the estimators should."""
    return torch.where(MASK, _t(values)[:, None], 0.0)


def test_grpo():
    result, returns = adv.grpo_advantages(REWARDS, MASK, INDEX)
    # group a: mean 0.5, std (unbiased) sqrt((0.25 + 0.25) / 1) = 0.70711 -> +-0.5 / (0.70711 + 1e-6) = +-0.70711
    # group b: mean 0.75, std sqrt((0.0625 + 0.0625) / 1) = 0.35355 -> +-0.25 / (0.35355 + 1e-6) = +-0.70710
    sa, sb = math.sqrt(0.5) + 1e-6, math.sqrt(0.125) + 1e-6
    _close(result, _per_seq([0.5 / sa, -0.5 / sa, 0.25 / sb, -0.25 / sb]))
    assert returns is result or torch.equal(returns, result)


def test_dr_grpo_is_grpo_without_std():
    result, _ = compute_advantages("dr_grpo", AdvantageInputs(REWARDS, MASK, index=INDEX))
    _close(result, _per_seq([0.5, -0.5, 0.25, -0.25]))  # score - group mean
    no_std, _ = adv.grpo_advantages(REWARDS, MASK, INDEX, norm_adv_by_std_in_grpo=False)
    _close(no_std, result)


def test_grpo_single_sample_group_keeps_raw_score():
    result, _ = adv.grpo_advantages(REWARDS, MASK, ["a", "a", "b", "c"])
    # groups b = {1}, c = {0.5}: mean 0, std 1 (verl) -> score / (1 + 1e-6)
    sa = math.sqrt(0.5) + 1e-6
    _close(result, _per_seq([0.5 / sa, -0.5 / sa, 1 / (1 + 1e-6), 0.5 / (1 + 1e-6)]))


def test_grpo_passk():
    result, _ = adv.grpo_passk_advantages(REWARDS, MASK, INDEX)
    # a: best seq0, 1 - 0 = 1, / (0.70711 + 1e-6); b: best seq2, 1 - 0.5 = 0.5, / (0.35355 + 1e-6); others 0
    _close(result, _per_seq([1 / (math.sqrt(0.5) + 1e-6), 0, 0.5 / (math.sqrt(0.125) + 1e-6), 0]))
    raw, _ = adv.grpo_passk_advantages(REWARDS, MASK, INDEX, norm_adv_by_std_in_grpo=False)
    _close(raw, _per_seq([1.0, 0, 0.5, 0]))


def test_grpo_passk_ties_and_small_groups():
    tied = _t([[0, 0, 1.0], [0, 1.0, 0], [1.0, 0, 0], [0, 0, 0.5]])  # group a = {1, 1}: max - second max = 0
    raw, _ = adv.grpo_passk_advantages(tied, MASK, INDEX, norm_adv_by_std_in_grpo=False)
    _close(raw, _per_seq([0, 0, 0.5, 0]))
    with pytest.raises(ValueError, match=r"at least 2 samples per group; group sizes are \[3, 1\]"):
        adv.grpo_passk_advantages(REWARDS, MASK, ["a", "a", "a", "b"])


def test_rloo():
    result, _ = adv.rloo_advantages(REWARDS, MASK, INDEX)
    # n = 2: score * 2 - mean * 2 = score - other: a: 1 - 0, 0 - 1; b: 1 - 0.5, 0.5 - 1
    _close(result, _per_seq([1.0, -1.0, 0.5, -0.5]))
    # a group of 3 {1, 0, 1} and a single sample {0.5}, which has no baseline and keeps its raw score
    result, _ = adv.rloo_advantages(REWARDS, MASK, ["a", "a", "a", "b"])
    # seq0: 1 - (0 + 1)/2 = 0.5; seq1: 0 - (1 + 1)/2 = -1; seq2: 1 - (1 + 0)/2 = 0.5; seq3 alone: 0.5
    _close(result, _per_seq([0.5, -1.0, 0.5, 0.5]))


def test_opo():
    result, _ = adv.opo_advantages(REWARDS, MASK, INDEX)
    # lengths 3, 2, 1, 3. a: (3*1 + 2*0) / 5 = 0.6 -> 0.4, -0.6; b: (1*1 + 3*0.5) / 4 = 0.625 -> 0.375, -0.125
    _close(result, _per_seq([0.4, -0.6, 0.375, -0.125]))


def test_gpg():
    result, _ = adv.gpg_advantages(REWARDS, MASK, INDEX)
    # alpha = B / #nonzero scores = 4 / 3; a: 4/3 * (+-0.5); b: 4/3 * (+-0.25)
    _close(result, _per_seq([2 / 3, -2 / 3, 1 / 3, -1 / 3]))


def test_reinforce_plus_plus_baseline():
    result, _ = adv.reinforce_plus_plus_baseline_advantages(REWARDS, MASK, INDEX)
    # centred 0.5 (3 tokens), -0.5 (2), 0.25 (1), -0.25 (3): mean (1.5 - 1 + 0.25 - 0.75) / 9 = 0
    # unbiased var (3*0.25 + 2*0.25 + 0.0625 + 3*0.0625) / 8 = 1.5 / 8 = 0.1875
    std = math.sqrt(0.1875 + 1e-8)
    _close(result, _per_seq([0.5 / std, -0.5 / std, 0.25 / std, -0.25 / std]))


# Dense-reward batch: 2 sequences, T = 3, the second of length 2 (its last entries are garbage under the mask).
D_MASK = _m([[1, 1, 1], [1, 1, 0]])
D_REWARDS = _t([[0.1, 0.0, 1.0], [0.0, 2.0, 0.0]])


def test_reinforce_plus_plus():
    result, returns = adv.reinforce_plus_plus_advantages(D_REWARDS, D_MASK, gamma=0.5)
    # seq0: G2 = 1, G1 = 0 + 0.5 * 1 = 0.5, G0 = 0.1 + 0.5 * 0.5 = 0.35; seq1: G1 = 2, G0 = 0 + 0.5 * 2 = 1
    _close(returns, [[0.35, 0.5, 1.0], [1.0, 2.0, 0.0]])
    valid = [0.35, 0.5, 1.0, 1.0, 2.0]  # mean 0.97, unbiased var 1.668 / 4 = 0.417
    mean, std = statistics.mean(valid), math.sqrt(statistics.variance(valid) + 1e-8)
    _close(result, [[(g - mean) / std for g in valid[:3]], [(g - mean) / std for g in valid[3:]] + [0.0]])


def test_reinforce_plus_plus_carries_through_masked_tokens():
    mask, rewards = _m([[1, 0, 1]]), _t([[0.0, 5.0, 0.5]])  # the 5 sits on a masked (observation) token
    _, returns = adv.reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # G2 = 0.5; t=1 masked: skipped (its 5 dropped, no discount), running stays 0.5; G0 = 0 + 0.5 * 0.5 = 0.25
    # (verl before PR #7300 reset the running return there and gave G0 = 0)
    _close(returns, [[0.25, 0.0, 0.5]])


def test_gae():
    values = _t([[0.5, 0.6, 0.7], [0.2, 0.4, 123.0]])  # 123 under the mask
    rewards = _t([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    result, returns = adv.gae_advantages(rewards, values, D_MASK, gamma=0.9, lam=0.8)
    # seq0: d2 = 1 - 0.7 = 0.3, A2 = 0.3; d1 = 0.9*0.7 - 0.6 = 0.03, A1 = 0.03 + 0.72*0.3 = 0.246
    #       d0 = 0.9*0.6 - 0.5 = 0.04, A0 = 0.04 + 0.72*0.246 = 0.21712
    # seq1: t2 masked (skipped); d1 = 0.5 - 0.4 = 0.1, A1 = 0.1; d0 = 0.9*0.4 - 0.2 = 0.16, A0 = 0.16 + 0.072 = 0.232
    raw = [0.21712, 0.246, 0.3, 0.232, 0.1]
    _close(returns, [[0.21712 + 0.5, 0.246 + 0.6, 0.3 + 0.7], [0.232 + 0.2, 0.1 + 0.4, 0.0]])
    mean, std = statistics.mean(raw), math.sqrt(statistics.variance(raw) + 1e-8)
    _close(result, [[(a - mean) / std for a in raw[:3]], [(a - mean) / std for a in raw[3:]] + [0.0]])


def test_gae_skips_masked_middle_tokens():
    mask, rewards, values = _m([[1, 0, 1]]), _t([[0.0, 0.0, 1.0]]), _t([[0.5, 9.0, 0.7]])
    _, returns = adv.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    # A2 = 1 - 0.7 = 0.3; t=1 skipped (V_next stays 0.7); A0 = (0 + 0.7 - 0.5) + 0.3 = 0.5 -> returns A + V
    _close(returns, [[1.0, 0.0, 1.0]])


def test_remax():
    result, returns = adv.remax_advantages(D_REWARDS, _t([0.5, 1.0]), D_MASK)
    # returns-to-go: seq0 1.1, 1, 1; seq1 2, 2, (masked) 0; minus baselines 0.5 and 1.0 on valid tokens
    _close(returns, [[1.1, 1.0, 1.0], [2.0, 2.0, 0.0]])
    _close(result, [[0.6, 0.5, 0.5], [1.0, 1.0, 0.0]])


# ---- Registry call convention, invariances, reference -------------------------------------------------------


def _inputs(rewards=REWARDS, mask=MASK, **extra):
    values = torch.linspace(0.1, 0.9, mask.numel(), dtype=F64).view(mask.shape)
    base = {"index": INDEX, "values": values, "reward_baselines": _t([0.5] * mask.shape[0])}
    return AdvantageInputs(rewards, mask, **(base | extra))


@pytest.mark.parametrize("name", ADV_ESTIMATORS.keys())
def test_every_estimator_zero_under_mask_and_ignores_masked_garbage(name):
    scalars = {"gamma": 0.9, "lam": 0.95}
    clean_adv, clean_ret = compute_advantages(name, _inputs(), **scalars)
    assert clean_adv.shape == clean_ret.shape == MASK.shape
    assert (clean_adv[~MASK] == 0).all() and (clean_ret[~MASK] == 0).all()
    clean = _inputs()
    dirty = _inputs(rewards=torch.where(MASK, REWARDS, 1e6), values=torch.where(MASK, clean.values, -1e6))
    dirty_adv, dirty_ret = compute_advantages(name, dirty, **scalars)
    torch.testing.assert_close(dirty_adv, clean_adv, atol=0, rtol=0)
    torch.testing.assert_close(dirty_ret, clean_ret, atol=0, rtol=0)


@pytest.mark.parametrize(
    "name, field", [("gae", "values"), ("grpo", "index"), ("remax", "reward_baselines"), ("rloo", "index")]
)
def test_missing_input_names_the_field(name, field):
    with pytest.raises(ValueError, match=f"{name}' needs AdvantageInputs.{field}"):
        compute_advantages(name, AdvantageInputs(REWARDS, MASK))


def test_unknown_estimator_and_bad_index():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; valid keys: gae, grpo"):
        compute_advantages("ppo", _inputs())
    with pytest.raises(ValueError, match="index has 3 entries but the batch has 4 rows"):
        adv.grpo_advantages(REWARDS, MASK, ["a", "a", "b"])


def test_index_types_agree():
    as_list, _ = adv.grpo_advantages(REWARDS, MASK, INDEX)
    as_numpy, _ = adv.grpo_advantages(REWARDS, MASK, np.array(INDEX, dtype=object))
    as_tensor, _ = adv.grpo_advantages(REWARDS, MASK, torch.tensor([7, 7, 3, 3]))
    torch.testing.assert_close(as_numpy, as_list, atol=0, rtol=0)
    torch.testing.assert_close(as_tensor, as_list, atol=0, rtol=0)


def test_estimators_do_not_mutate_inputs():
    inputs = _inputs()
    before = {k: v.clone() for k, v in vars(inputs).items() if isinstance(v, torch.Tensor)}
    for name in ADV_ESTIMATORS.keys():
        compute_advantages(name, inputs)
    for key, tensor in before.items():
        assert torch.equal(getattr(inputs, key), tensor), key


def _naive_group_baselines(scores, lengths, index):
    """Per-row python reference: (grpo, rloo, opo) advantages with verl's loops' semantics."""
    groups = {}
    for i, key in enumerate(index):
        groups.setdefault(key, []).append(i)
    grpo, rloo, opo = [], [], []
    for i, key in enumerate(index):
        members = [scores[j] for j in groups[key]]
        n = len(members)
        mean = sum(members) / n if n > 1 else 0.0
        std = statistics.stdev(members) if n > 1 else 1.0
        grpo.append((scores[i] - mean) / (std + 1e-6))
        rloo.append(scores[i] - (sum(members) - scores[i]) / (n - 1) if n > 1 else scores[i])
        weights = [lengths[j] for j in groups[key]]
        base = sum(w * s for w, s in zip(weights, members)) / sum(weights) if n > 1 else 0.0
        opo.append(scores[i] - base)
    return grpo, rloo, opo


def test_vectorised_group_estimators_match_naive_reference():
    gen = torch.Generator().manual_seed(0)
    batch, length = 24, 6
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    scores = torch.randint(0, 3, (batch,), generator=gen).to(F64) / 2  # ties on purpose
    rewards = torch.zeros(batch, length, dtype=F64).scatter(1, (lengths - 1)[:, None], scores[:, None])
    index = [f"p{int(k)}" for k in torch.randint(0, 7, (batch,), generator=gen)]  # groups of varying size
    grpo, rloo, opo = _naive_group_baselines(scores.tolist(), lengths.tolist(), index)
    for fn, expected in ((adv.grpo_advantages, grpo), (adv.rloo_advantages, rloo), (adv.opo_advantages, opo)):
        result, _ = fn(rewards, mask, index)
        torch.testing.assert_close(result[:, 0], _t(expected), atol=1e-9, rtol=0)
