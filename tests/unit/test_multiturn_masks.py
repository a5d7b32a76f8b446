"""Multi-turn response masks with holes (issue 14): every estimator, loss, KL and aggregation in stages/core.

A multi-turn response interleaves the model's tokens with tool/user tokens; `response_mask` is True only on
the model's own tokens, so it has holes in the middle:

    t       0  1  2  3  4  5  6  7  8  9
    mask    1  1  0  0  1  1  0  1  0  0
            model tool  model tool model pad

Semantics (verl-project/verl 1dda039b, `verl/trainer/ppo/core_algos.py`; REINFORCE++ after PR #7300):
    gae                  the reverse scan skips masked positions: V_next and A_next carry across a tool span.
    reinforce_plus_plus  the running return carries across masked positions (no reset, no discount).
    remax                reverse cumsum of the rewards on valid tokens, minus the baseline on valid tokens.
    outcome estimators   one score per sequence broadcast over the valid tokens; opo's L counts valid tokens.
    losses, KL, values   only True entries are counted, by every aggregation mode.

Why a multi-turn row equals the same row with its masked spans cut out (`test_*_equals_compacted`): the
scans of gae and reinforce_plus_plus step from one valid token to the next one, whatever lies between;
remax sums valid rewards; the outcome estimators only see per-sequence scores and valid-token counts; the
whitening (gae, reinforce_plus_plus, reinforce_plus_plus_baseline) and every loss reduce over the set of
valid tokens. The exceptions: `seq-mean-token-sum-norm` divides by the padded width T by default (verl's
`loss_mask.shape[-1]`, tool tokens included), so it matches only with an explicit `max_response_length`;
and clip_cov draws its random pick per (b, t) position, so a different layout draws a different subset.
"""

import math
import statistics

import pytest
import torch

from stages.core import (
    ADV_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AdvantageInputs,
    agg_loss,
    apply_kl_penalty,
    clipped_value_loss,
    compute_advantages,
    kl_loss,
)
from stages.core import advantages as adv

F64 = torch.float64
ATOL = 1e-12
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
GARBAGE = 1e6  # under the mask: large enough to show up anywhere it leaks


def _t(rows):
    return torch.tensor(rows, dtype=F64)


def _m(rows):
    return torch.tensor(rows, dtype=torch.bool)


def _close(actual, expected, atol=1e-9):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0)


def _dirty(x, mask, fill=GARBAGE):
    """`x` with `fill` at every masked position."""
    return torch.where(mask, x, torch.full_like(x, fill))


def _compact(x, mask, width=None, fill=0.0):
    """Cut the masked spans out: each row's valid entries moved left, right-padded with `fill`.

    Returns (compacted x, compacted mask), (B, width); width defaults to the longest row's valid count.
    """
    lengths = mask.sum(-1)
    width = int(lengths.max()) if width is None else width
    out = torch.full((x.shape[0], width), fill, dtype=x.dtype)
    for b in range(x.shape[0]):
        out[b, : int(lengths[b])] = x[b][mask[b]]
    return out, torch.arange(width)[None, :] < lengths[:, None]


# ---- One 3-turn row, dense rewards: the token-level estimators by hand --------------------------------------

ROW_MASK = _m([[1, 1, 0, 0, 1, 1, 0, 1, 0, 0]])
# rewards on valid tokens: 0.1 @t0, 0.2 @t5, 1.0 @t7 (outcome); 9.0 on tool tokens and padding (must be ignored)
ROW_REWARDS = _t([[0.1, 0.0, 9.0, 9.0, 0.0, 0.2, 9.0, 1.0, 9.0, 9.0]])


def _whiten_valid(raw):
    """(x - mean) / sqrt(unbiased var + 1e-8) over a list of valid values, as masked_whiten does."""
    mean, var = statistics.mean(raw), statistics.variance(raw)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in raw]


def _on_row(valid_values):
    """Scatter the 5 values of the valid tokens t0, t1, t4, t5, t7 into a (1, 10) row, 0 elsewhere."""
    row = [0.0] * 10
    for t, x in zip((0, 1, 4, 5, 7), valid_values):
        row[t] = x
    return [row]


def test_gae_three_turns_by_hand():
    rewards = _t([[0.0, 0.0, 9.0, 9.0, 0.0, 0.0, 9.0, 1.0, 9.0, 9.0]])  # outcome 1 @t7, garbage 9 under the mask
    values = _t([[0.5, 0.4, 50.0, 50.0, 0.6, 0.3, 50.0, 0.8, 50.0, 50.0]])  # garbage 50 under the mask
    advantages, returns = adv.gae_advantages(rewards, values, ROW_MASK, gamma=0.9, lam=0.5)
    # gamma * lam = 0.45; "next" is the next *valid* token; tool tokens t6, t3, t2 and pad t8, t9 are skipped
    # t7: d = 1 + 0.9*0 - 0.8 = 0.2                          A7 = 0.2
    # t5: d = 0 + 0.9*0.8 - 0.3 = 0.42 (V_next = V7, over t6) A5 = 0.42 + 0.45*0.2 = 0.51
    # t4: d = 0 + 0.9*0.3 - 0.6 = -0.33                      A4 = -0.33 + 0.45*0.51 = -0.1005
    # t1: d = 0 + 0.9*0.6 - 0.4 = 0.14 (V_next = V4, over t3, t2)
    #                                                        A1 = 0.14 + 0.45*(-0.1005) = 0.094775
    # t0: d = 0 + 0.9*0.4 - 0.5 = -0.14                      A0 = -0.14 + 0.45*0.094775 = -0.09735125
    raw = [-0.09735125, 0.094775, -0.1005, 0.51, 0.2]
    # returns = A + V on valid tokens: 0.40264875, 0.494775, 0.4995, 0.81, 1.0
    _close(returns, _on_row([-0.09735125 + 0.5, 0.094775 + 0.4, -0.1005 + 0.6, 0.51 + 0.3, 0.2 + 0.8]))
    _close(advantages, _on_row(_whiten_valid(raw)))  # mean 0.12138475 over the 5 valid tokens


def test_reinforce_plus_plus_three_turns_by_hand():
    advantages, returns = adv.reinforce_plus_plus_advantages(ROW_REWARDS, ROW_MASK, gamma=0.5)
    # G7 = 1.0; t6 skipped; G5 = 0.2 + 0.5*1.0 = 0.7; G4 = 0 + 0.5*0.7 = 0.35; t3, t2 skipped;
    # G1 = 0 + 0.5*0.35 = 0.175; G0 = 0.1 + 0.5*0.175 = 0.1875   (verl before PR #7300: G4 = 0.35, G1 = G0 = 0.1)
    _close(returns, _on_row([0.1875, 0.175, 0.35, 0.7, 1.0]))
    # whiten: mean 2.4125 / 5 = 0.4825; squared deviations 0.087025 + 0.09455625 + 0.01755625 + 0.04730625
    # + 0.26780625 = 0.51425; unbiased var 0.51425 / 4 = 0.1285625
    std = math.sqrt(0.1285625 + 1e-8)
    _close(advantages, _on_row([(g - 0.4825) / std for g in (0.1875, 0.175, 0.35, 0.7, 1.0)]))


def test_remax_three_turns_by_hand():
    advantages, returns = adv.remax_advantages(ROW_REWARDS, _t([0.5]), ROW_MASK)
    # undiscounted return-to-go over valid rewards: t7 1.0; t5, t4, t1 1.2; t0 1.3; minus the greedy score 0.5
    _close(returns, _on_row([1.3, 1.2, 1.2, 1.2, 1.0]))
    _close(advantages, _on_row([0.8, 0.7, 0.7, 0.7, 0.5]))


# ---- A batch of multi-turn rows, outcome scores: the group estimators by hand --------------------------------

MT_MASK = _m([
    [1, 1, 0, 0, 1, 1, 0, 1, 0, 0],  # 3 turns, L = 5 valid tokens (8 non-pad), last valid t7
    [1, 1, 1, 0, 0, 0, 1, 1, 1, 0],  # 2 turns, L = 6 (9 non-pad), last valid t8
    [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],  # one turn filling the width, L = 10, last valid t9
    [1, 1, 1, 0, 0, 0, 0, 0, 0, 0],  # one short turn (a prefix mask), L = 3, last valid t2
])  # fmt: skip
LAST_VALID = [7, 8, 9, 2]
SCORES = [1.0, 0.0, 1.0, 0.5]
MT_REWARDS = torch.zeros(4, 10, dtype=F64).index_put((torch.arange(4), torch.tensor(LAST_VALID)), _t(SCORES))
MT_INDEX = ["a", "a", "b", "b"]  # group a = {row0: 1, row1: 0}, group b = {row2: 1, row3: 0.5}
LENGTHS = [5, 6, 10, 3]

SA, SB = math.sqrt(0.5) + 1e-6, math.sqrt(0.125) + 1e-6  # group stds (unbiased) + eps: a 0.70711, b 0.35355
CENTRED = [0.5, -0.5, 0.25, -0.25]  # score - group mean (a: 0.5, b: 0.75)
# reinforce_plus_plus_baseline whitens CENTRED repeated over each row's valid tokens (5, 6, 10, 3 = 24 tokens):
# mean 1.25 / 24 = 0.0520833; sum of squares 3.5625; unbiased var (3.5625 - 24 * 0.0520833^2) / 23 = 0.1520607
RPP_MEAN = 1.25 / 24
RPP_STD = math.sqrt((3.5625 - 24 * RPP_MEAN**2) / 23 + 1e-8)

OUTCOME_EXPECTED = {
    "grpo": [0.5 / SA, -0.5 / SA, 0.25 / SB, -0.25 / SB],  # (score - mean_g) / (std_g + eps)
    "dr_grpo": CENTRED,  # no std division
    "grpo_passk": [1 / SA, 0.0, 0.5 / SB, 0.0],  # best of a: 1 - 0; best of b: 1 - 0.5; others 0
    "rloo": [1.0, -1.0, 0.5, -0.5],  # n = 2: score - the other score
    # baseline_g = sum(L * score) / sum(L) with L = *valid* tokens (tool tokens not counted, as verl):
    # a: (5*1 + 6*0) / 11 = 5/11 -> 6/11, -5/11;  b: (10*1 + 3*0.5) / 13 = 11.5/13 -> 1.5/13, -5/13
    # (counting tool tokens, L = 8, 9 for a, would give a baseline of 8/17 instead)
    "opo": [6 / 11, -5 / 11, 1.5 / 13, -5 / 13],
    "gpg": [2 / 3, -2 / 3, 1 / 3, -1 / 3],  # alpha = 4 rows / 3 nonzero scores; alpha * (score - mean_g)
    "reinforce_plus_plus_baseline": [(c - RPP_MEAN) / RPP_STD for c in CENTRED],
}


@pytest.mark.parametrize("name", OUTCOME_EXPECTED)
def test_outcome_estimators_broadcast_over_valid_tokens_by_hand(name):
    result, returns = compute_advantages(name, AdvantageInputs(MT_REWARDS, MT_MASK, index=MT_INDEX))
    expected = torch.where(MT_MASK, _t(OUTCOME_EXPECTED[name])[:, None], 0.0)  # 0 on tool tokens and padding
    _close(result, expected)
    _close(returns, expected)


def test_outcome_estimators_lengths_are_valid_token_counts():
    """The rpp_baseline reference above assumes 5, 6, 10, 3 valid tokens: check the mask says so."""
    assert MT_MASK.sum(-1).tolist() == LENGTHS
    assert [int(torch.nonzero(row).max()) for row in MT_MASK] == LAST_VALID


# ---- Invariances: masked values never matter; cutting the masked spans out changes nothing -----------------


def _random_multiturn(seed, batch=9, width=12):
    """Random multi-turn masks (first token the model's, random tool spans, right padding), dense rewards,
    values, 3 groups of 3, greedy baselines."""
    gen = torch.Generator().manual_seed(seed)
    holes = torch.rand(batch, width, generator=gen) < 0.35
    holes[:, 0] = False
    lengths = torch.randint(3, width + 1, (batch,), generator=gen)
    mask = ~holes & (torch.arange(width)[None, :] < lengths[:, None])
    rewards = torch.randn(batch, width, dtype=F64, generator=gen)
    values = torch.randn(batch, width, dtype=F64, generator=gen)
    baselines = torch.randn(batch, dtype=F64, generator=gen)
    index = [f"p{i // 3}" for i in range(batch)]
    assert (mask[:, 1:].int() - mask[:, :-1].int() == 1).any(), "the batch must have holes"
    return AdvantageInputs(rewards, mask, index=index, values=values, reward_baselines=baselines)


def _estimate(name, inputs):
    return compute_advantages(name, inputs, gamma=0.9, lam=0.7)


@pytest.mark.parametrize("name", ADV_ESTIMATORS.keys())
def test_estimators_ignore_everything_under_the_holes(name):
    clean = _random_multiturn(0)
    mask = clean.response_mask
    clean_adv, clean_ret = _estimate(name, clean)
    for fill in (GARBAGE, float("nan")):
        dirty = AdvantageInputs(_dirty(clean.token_level_rewards, mask, fill), mask, index=clean.index,
                                values=_dirty(clean.values, mask, -fill), reward_baselines=clean.reward_baselines)
        dirty_adv, dirty_ret = _estimate(name, dirty)
        torch.testing.assert_close(dirty_adv, clean_adv, atol=0, rtol=0)
        torch.testing.assert_close(dirty_ret, clean_ret, atol=0, rtol=0)
    assert (clean_adv[~mask] == 0).all() and (clean_ret[~mask] == 0).all()


@pytest.mark.parametrize("name", ADV_ESTIMATORS.keys())
def test_estimators_equal_compacted(name):
    """All eleven estimators: a multi-turn row gives, on its valid tokens, what the row without its tool spans
    gives (module docstring: the scans step valid token to valid token, the rest reduces over valid tokens)."""
    holed = _random_multiturn(1)
    mask = holed.response_mask
    rewards, compact_mask = _compact(holed.token_level_rewards, mask)
    values, _ = _compact(holed.values, mask)
    compact = AdvantageInputs(rewards, compact_mask, index=holed.index, values=values,
                              reward_baselines=holed.reward_baselines)
    holed_adv, holed_ret = _estimate(name, holed)
    compact_adv, compact_ret = _estimate(name, compact)
    torch.testing.assert_close(holed_adv[mask], compact_adv[compact_mask], atol=ATOL, rtol=0)
    torch.testing.assert_close(holed_ret[mask], compact_ret[compact_mask], atol=ATOL, rtol=0)


# ---- Loss aggregation, policy losses, KL, value loss ---------------------------------------------------------

AGG_MASK = _m([[1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 0, 0]])  # 3 and 2 valid tokens, holes in both rows
AGG_LOSS = _t([[1.0, 100.0, 100.0, 2.0, 3.0, 100.0], [4.0, 100.0, 6.0, 100.0, 100.0, 100.0]])  # 100: garbage


@pytest.mark.parametrize("mode, kwargs, expected", [
    ("token-mean", {}, (1 + 2 + 3 + 4 + 6) / 5),  # 16 / 5 valid tokens = 3.2
    ("seq-mean-token-sum", {}, (6 + 10) / 2),  # row sums 6, 10 over 2 sequences = 8
    ("seq-mean-token-mean", {}, (6 / 3 + 10 / 2) / 2),  # row means 2, 5 -> 3.5
    ("seq-mean-token-sum-norm", {}, (6 + 10) / (2 * 6)),  # T_max = padded width 6 (verl's shape[-1]) -> 4/3
    ("seq-mean-token-sum-norm", {"max_response_length": 4}, (6 + 10) / (2 * 4)),  # explicit T_max -> 2
])  # fmt: skip
def test_agg_modes_count_only_valid_tokens_by_hand(mode, kwargs, expected):
    _close(agg_loss(AGG_LOSS, AGG_MASK, mode, **kwargs), expected, atol=ATOL)
    _close(agg_loss(_dirty(AGG_LOSS, AGG_MASK, float("nan")), AGG_MASK, mode, **kwargs), expected, atol=ATOL)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_modes_equal_compacted(mode):
    compact, compact_mask = _compact(AGG_LOSS, AGG_MASK)
    kwargs = {"max_response_length": 6}  # sum-norm's T_max must be the same number for both layouts
    _close(agg_loss(compact, compact_mask, mode, **kwargs), agg_loss(AGG_LOSS, AGG_MASK, mode, **kwargs), ATOL)


def _policy_batch(seed):
    inputs = _random_multiturn(seed)
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(inputs.response_mask.shape, dtype=F64, generator=gen) * 3
    logprobs = old + 0.3 * torch.randn(old.shape, dtype=F64, generator=gen)  # some ratios get clipped
    advantages, _ = compute_advantages("grpo", inputs)
    advantages = advantages + 0.5 * torch.randn(old.shape, dtype=F64, generator=gen)  # token-level variety
    return old, logprobs, advantages, inputs.response_mask


def _policy_loss(name, old, logprobs, advantages, mask, mode, **kwargs):
    leaf = logprobs.clone().requires_grad_(True)
    extra = {"generator": torch.Generator().manual_seed(0)} if name == "clip_cov" else {}
    loss, metrics = POLICY_LOSSES.get(name)(old, leaf, advantages, mask, mode, **CLIP, **kwargs, **extra)
    loss.backward()
    return loss, leaf.grad, metrics


def test_vanilla_on_policy_three_turns_by_hand():
    advantages = _t([[1.0, 2.0, 50.0, 50.0, -1.0, 3.0, 50.0, 0.5, 50.0, 50.0]])  # 50 under the mask
    logprobs = _t([[-1.0, -0.5, -9.0, -9.0, -2.0, -0.1, -9.0, -0.3, -9.0, -9.0]])
    loss, grad, metrics = _policy_loss("vanilla", logprobs, logprobs, advantages, ROW_MASK, "token-mean")
    # r = 1 everywhere, nothing clipped: loss = -mean of A over the 5 valid tokens = -(1 + 2 - 1 + 3 + 0.5) / 5
    _close(loss, -5.5 / 5, atol=ATOL)
    _close(grad, _on_row([-1.0 / 5, -2.0 / 5, 1.0 / 5, -3.0 / 5, -0.5 / 5]), atol=ATOL)  # d/d log pi = -A / 5
    _close(metrics["actor/pg_clipfrac"], 0.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", POLICY_LOSSES.keys())
def test_policy_losses_ignore_everything_under_the_holes(name, mode):
    old, logprobs, advantages, mask = _policy_batch(2)
    loss, grad, metrics = _policy_loss(name, old, logprobs, advantages, mask, mode)
    dirty = (_dirty(old, mask, -GARBAGE), _dirty(logprobs, mask), _dirty(advantages, mask))
    dirty_loss, dirty_grad, dirty_metrics = _policy_loss(name, *dirty, mask, mode)
    torch.testing.assert_close(dirty_loss, loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(dirty_grad, grad, atol=ATOL, rtol=0)
    assert (grad[~mask] == 0).all()
    for key in metrics:
        torch.testing.assert_close(dirty_metrics[key], metrics[key], atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES.keys() if n != "clip_cov"])  # see module docstring
def test_policy_losses_equal_compacted(name, mode):
    old, logprobs, advantages, mask = _policy_batch(3)
    width = {"max_response_length": mask.shape[-1]}
    loss, grad, metrics = _policy_loss(name, old, logprobs, advantages, mask, mode, **width)
    (c_old, c_mask), (c_logprobs, _), (c_adv, _) = (_compact(x, mask) for x in (old, logprobs, advantages))
    c_loss, c_grad, c_metrics = _policy_loss(name, c_old, c_logprobs, c_adv, c_mask, mode, **width)
    torch.testing.assert_close(c_loss, loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(c_grad[c_mask], grad[mask], atol=ATOL, rtol=0)
    for key in metrics:
        torch.testing.assert_close(c_metrics[key], metrics[key], atol=ATOL, rtol=0)


def test_kl_penalty_only_on_valid_tokens_by_hand():
    scores = torch.zeros(1, 10, dtype=F64).index_put((torch.tensor([0]), torch.tensor([7])), _t([1.0]))
    ref = torch.zeros(1, 10, dtype=F64)
    # k1 = old - ref: 0.2, -0.1 | 0.3, 0.0 | 0.4 on the valid tokens; 5.0 on tool tokens and padding
    old = _t([[0.2, -0.1, 5.0, 5.0, 0.3, 0.0, 5.0, 0.4, 5.0, 5.0]])
    rewards, metrics = apply_kl_penalty(scores, old, ref, ROW_MASK, kl_coef=0.5, kl_type="k1")
    # rewards = scores - 0.5 * k1 on valid tokens: -0.1, 0.05, -0.15, 0, 1 - 0.2 = 0.8; tool tokens keep 0
    _close(rewards, _on_row([-0.1, 0.05, -0.15, 0.0, 0.8]), atol=ATOL)
    _close(metrics["actor/reward_kl_penalty"], (0.2 - 0.1 + 0.3 + 0.0 + 0.4) / 5, atol=ATOL)  # 0.16


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_kl_loss_ignores_holes_and_equals_compacted(mode):
    _, logprobs, _, mask = _policy_batch(4)
    ref = logprobs.detach() + 0.2 * torch.randn(logprobs.shape, dtype=F64, generator=torch.Generator().manual_seed(4))
    width = {"max_response_length": mask.shape[-1]}

    def loss_and_grad(lp, rf, m):
        leaf = lp.clone().requires_grad_(True)
        loss, _ = kl_loss(leaf, rf, m, "low_var_kl", mode, **width)
        loss.backward()
        return loss, leaf.grad

    loss, grad = loss_and_grad(logprobs, ref, mask)
    dirty_loss, dirty_grad = loss_and_grad(_dirty(logprobs, mask), _dirty(ref, mask, -GARBAGE), mask)
    (c_lp, c_mask), (c_ref, _) = _compact(logprobs, mask), _compact(ref, mask)
    c_loss, c_grad = loss_and_grad(c_lp, c_ref, c_mask)
    for other in (dirty_loss, c_loss):
        torch.testing.assert_close(other, loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(dirty_grad, grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(c_grad[c_mask], grad[mask], atol=ATOL, rtol=0)
    assert (grad[~mask] == 0).all()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gae_then_value_loss_ignores_holes_and_equals_compacted(mode):
    """The critic path end to end: GAE returns on a multi-turn batch train the critic on valid tokens only."""
    inputs = _random_multiturn(5)
    mask = inputs.response_mask
    new_values = inputs.values + 0.3 * torch.randn(mask.shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    width = {"max_response_length": mask.shape[-1]}

    def loss_and_grad(rewards, old_values, values, m):
        _, returns = adv.gae_advantages(rewards, old_values, m, gamma=0.9, lam=0.7)
        leaf = values.clone().requires_grad_(True)
        loss, metrics = clipped_value_loss(leaf, old_values, returns, m, 0.2, mode, **width)
        loss.backward()
        return loss, leaf.grad, metrics

    loss, grad, metrics = loss_and_grad(inputs.token_level_rewards, inputs.values, new_values, mask)
    dirty = (_dirty(inputs.token_level_rewards, mask), _dirty(inputs.values, mask, -GARBAGE), _dirty(new_values, mask))
    dirty_loss, dirty_grad, _ = loss_and_grad(*dirty, mask)
    compact = [_compact(x, mask) for x in (inputs.token_level_rewards, inputs.values, new_values)]
    c_mask = compact[0][1]
    c_loss, c_grad, c_metrics = loss_and_grad(*(x for x, _ in compact), c_mask)
    for other in (dirty_loss, c_loss):
        torch.testing.assert_close(other, loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(dirty_grad, grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(c_grad[c_mask], grad[mask], atol=ATOL, rtol=0)
    for key in metrics:
        torch.testing.assert_close(c_metrics[key], metrics[key], atol=ATOL, rtol=0)
    assert (grad[~mask] == 0).all()


# ---- Where the outcome score goes ------------------------------------------------------------------------------


def test_token_level_scores_on_last_valid_token():
    from stages.batch import token_level_scores

    out = token_level_scores(torch.tensor(SCORES), MT_MASK)
    # the score must sit on the last *valid* token (t7, t8, t9, t2), not at L - 1 = t4, t5, t9, t2: the
    # estimators ignore rewards under the mask, and t5 of row 1 is a tool token
    expected = torch.zeros(4, 10).index_put((torch.arange(4), torch.tensor(LAST_VALID)), torch.tensor(SCORES))
    assert torch.equal(out, expected)


def test_response_length_counts_tool_tokens_as_verl_does():
    from stages.batch import build_batch
    from stages.rl_data import data_metrics

    # sample 0: 2 model tokens, 3 tool tokens, 1 model token; sample 1: 4 model tokens (single turn)
    batch = build_batch([[5, 6, 7], [8]], [[9, 9, 1, 1, 1, 9], [9, 9, 9, 9]], [[0.0] * 6, [0.0] * 4], pad_token_id=0,
                        response_masks=[[1, 1, 0, 0, 0, 1], [1, 1, 1, 1]])
    batch.tensors["scores"] = batch.tensors["token_level_rewards"] = torch.zeros(2, 6)
    assert batch.response_lengths().tolist() == [6, 4]
    metrics = data_metrics(batch, max_response_length=6)
    assert metrics["response_length/mean"] == 5 and metrics["response_length/clip_ratio"] == 0.5
    assert metrics["response_length/model_tokens/mean"] == 3.5 and metrics["prompt_length/mean"] == 2
