"""Rollout correction (stages/core/rollout_correction.py, infra/rollout_correction.py, stages/rl_correction.py):
each mode against hand arithmetic, the loss with weights, bypass in the actor's loss, off = unchanged.

The common case: two sequences, three response slots, the second sequence two tokens long. Log ratios
lr = log pi_old - log pi_rollout are chosen so that the ratios r = exp(lr) are round numbers:

    row 0: r = [2, 1, 0.5]                 (lr = [ln 2, 0, -ln 2];  sequence ratio prod r = 1)
    row 1: r = [3, 0.5, (masked: lr 7)]    (lr = [ln 3, -ln 2];     sequence ratio prod r = 1.5)
"""

from __future__ import annotations

import math

import pytest
import torch

from infra.config import ConfigError, load_config
from infra.rollout_correction import RS_OPTIONS, RolloutCorrectionConfig
from stages.batch import build_batch
from stages.core import POLICY_LOSSES
from stages.core.rollout_correction import rejection_mask, rollout_correction
from stages.rl_correction import corrected_batch
from stages.workers.actor_loss import actor_loss
from stages.workers.train_engine import global_denominators

LN2, LN3 = math.log(2.0), math.log(3.0)
MASK = torch.tensor([[True, True, True], [True, True, False]])
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.25, -1.0]], dtype=torch.float64)
OLD = ROLLOUT + torch.tensor([[LN2, 0.0, -LN2], [LN3, -LN2, 7.0]], dtype=torch.float64)  # 7: under the mask


def correct(**params):
    return rollout_correction(OLD, ROLLOUT, MASK, **params)


def close(value, expected, tol=1e-6):
    return abs(float(value) - expected) < tol


def test_token_tis_truncates_each_token_weight():
    weights, kept, m = correct(rollout_is="token", rollout_is_threshold=1.5)
    # r = [2, 1, 0.5 | 3, 0.5]; min(r, 1.5) = [1.5, 1, 0.5 | 1.5, 0.5]; 0 under the mask
    assert torch.allclose(weights, torch.tensor([[1.5, 1.0, 0.5], [1.5, 0.5, 0.0]], dtype=weights.dtype))
    assert kept is MASK  # no rejection configured: the mask itself
    # before truncation: mean (2 + 1 + 0.5 + 3 + 0.5) / 5 = 1.4; max 3, min 0.5
    assert close(m["rollout_corr/rollout_is_mean"], 1.4) and close(m["rollout_corr/rollout_is_max"], 3.0)
    assert close(m["rollout_corr/rollout_is_min"], 0.5)
    # above C = 1.5: {2, 3} -> 2/5; below 1/C = 0.667: {0.5, 0.5} -> 2/5
    assert close(m["rollout_corr/rollout_is_ratio_fraction_high"], 0.4)
    assert close(m["rollout_corr/rollout_is_ratio_fraction_low"], 0.4)
    assert not weights.requires_grad


def test_sequence_tis_puts_the_truncated_product_on_every_token():
    weights, _, m = correct(rollout_is="sequence", rollout_is_threshold=1.2)
    # row 0: prod r = 2 * 1 * 0.5 = 1 -> 1; row 1: 3 * 0.5 = 1.5 -> min(1.5, 1.2) = 1.2
    assert torch.allclose(weights, torch.tensor([[1.0, 1.0, 1.0], [1.2, 1.2, 0.0]], dtype=weights.dtype))
    # token mean of the untruncated weights: (3 * 1 + 2 * 1.5) / 5 = 1.2; extremes 1.5 and 1 (log space)
    assert close(m["rollout_corr/rollout_is_mean"], 1.2) and close(m["rollout_corr/rollout_is_max"], 1.5)
    assert close(m["rollout_corr/rollout_is_min"], 1.0)
    assert close(m["rollout_corr/rollout_is_ratio_fraction_high"], 0.5)  # one of two sequences above 1.2
    assert close(m["rollout_corr/rollout_is_seq_mean"], 1.25)  # (1 + 1.5) / 2


def test_batch_normalized_weights_average_one():
    token, _, m = correct(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    # truncated [2, 1, 0.5 | 2, 0.5], mean 6/5 = 1.2 -> divided by 1.2
    expected = torch.tensor([[2.0, 1.0, 0.5], [2.0, 0.5, 0.0]]) / 1.2
    assert torch.allclose(token, expected.to(token.dtype))
    assert close(m["rollout_corr/rollout_is_batch_norm_factor"], 1.2)
    seq, _, m = correct(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    # one weight per sequence: [1, 1.5], mean 1.25 -> [0.8, 1.2]
    assert torch.allclose(seq, torch.tensor([[0.8, 0.8, 0.8], [1.2, 1.2, 0.0]], dtype=seq.dtype))


def test_icepop_masks_tokens_whose_ratio_leaves_the_bounds():
    _, kept, m = correct(rejections=[("token_k1", 0.6, 2.5)])
    # keep 0.6 <= r <= 2.5: row 0 [2 yes, 1 yes, 0.5 no]; row 1 [3 no, 0.5 no]. (verl's code compares -log r with
    # [log 0.6, log 2.5], i.e. keeps 0.4 <= r <= 1.67: it would reject the 2 and keep both 0.5s.)
    assert kept.tolist() == [[True, True, False], [False, False, False]]
    assert close(m["rollout_corr/rollout_rs_masked_fraction"], 3 / 5)
    assert close(m["rollout_corr/rollout_rs_seq_masked_fraction"], 1.0)  # both sequences lost a token
    assert close(m["rollout_corr/rollout_rs_token_k1_mean"], -math.log(1.5) / 5)  # mean of -lr


def test_rejection_of_whole_sequences():
    # Seq-MIS: the sequence ratio [1, 1.5] within [0.5, 1.4]: row 1 rejected whole
    _, kept, m = correct(rejections=[("seq_sum_k1", 0.5, 1.4)])
    assert kept.tolist() == [[True, True, True], [False, False, False]]
    assert close(m["rollout_corr/rollout_rs_masked_fraction"], 2 / 5)
    assert close(m["rollout_corr/rollout_rs_seq_masked_fraction"], 0.5)
    # geometric mean ratio: row 0 1, row 1 sqrt(1.5) = 1.2247 > 1.2: rejected
    _, kept, _ = correct(rejections=[("seq_mean_k1", 1 / 1.2, 1.2)])
    assert kept.tolist() == [[True, True, True], [False, False, False]]
    # k3 = r - 1 - ln r: row 0 max(0.3069, 0, 0.1931); row 1 max(3 - 1 - ln 3 = 0.9014, 0.1931); bound 0.5
    _, kept, m = correct(rejections=[("seq_max_k3", None, 0.5)])
    assert kept.tolist() == [[True, True, True], [False, False, False]]
    assert close(m["rollout_corr/rollout_rs_seq_max_k3_max"], 2 - LN3)
    # every criterion must pass: token_k2 (lr^2 / 2 <= 0.2: |lr| <= 0.632, rejects ln 2 and ln 3 tokens) and seq_sum
    _, kept, _ = correct(rejections=[("token_k2", None, 0.2), ("seq_sum_k1", 0.5, 1.4)])
    assert kept.tolist() == [[False, True, False], [False, False, False]]


def test_every_configurable_criterion_runs_and_an_empty_row_is_no_problem():
    mask = MASK.clone()
    mask[1] = False  # a sequence without a valid token
    for option in RS_OPTIONS:
        lower = 0.5 if option.endswith("k1") else None
        kept, metrics = rejection_mask(torch.where(mask, OLD - ROLLOUT, 0.0), mask, [(option, lower, 2.0)])
        assert not kept[1].any() and all(torch.isfinite(v) for v in metrics.values()), option
    with pytest.raises(ValueError, match="seq_max only with k2, k3"):
        rejection_mask(OLD - ROLLOUT, MASK, [("seq_max_k1", 0.5, 2.0)])


def test_offpolicy_gap_metrics():
    _, _, m = correct()
    # kl = mean(log pi_rollout - log pi_old) = -(ln 2 + 0 - ln 2 + ln 3 - ln 2) / 5 = -ln(1.5) / 5
    assert close(m["rollout_corr/kl"], -math.log(1.5) / 5)
    # per sequence mean(log pi_rollout) - mean(log pi_old) = -mean(lr): [0, -ln(1.5) / 2]; batch mean
    assert close(m["rollout_corr/log_ppl_diff"], -math.log(1.5) / 4)
    assert close(m["rollout_corr/log_ppl_diff_min"], -math.log(1.5) / 2)
    # chi2_token = mean(r^2) - 1 = (4 + 1 + 0.25 + 9 + 0.25) / 5 - 1 = 1.9; chi2_seq = (1 + 1.5^2) / 2 - 1 = 0.625
    assert close(m["rollout_corr/chi2_token"], 1.9) and close(m["rollout_corr/chi2_seq"], 0.625)
    # k3 = mean(r - 1 - ln r) = (0.30685 + 0 + 0.19315 + 0.90139 + 0.19315) / 5
    assert close(m["rollout_corr/k3_kl"], (1 - LN2 + 0 + (LN2 - 0.5) + (2 - LN3) + (LN2 - 0.5)) / 5)
    # training ppl per sequence exp(-mean log pi_old), averaged over the two sequences
    mean_old = [(OLD[0].sum() / 3).item(), (OLD[1, :2].sum() / 2).item()]
    assert close(m["rollout_corr/training_ppl"], sum(math.exp(-x) for x in mean_old) / 2)
    assert "rollout_corr/rollout_is_mean" not in m and "rollout_corr/rollout_rs_masked_fraction" not in m


# ---- config ---------------------------------------------------------------------------------------------


def test_config_follows_verls_threshold_rules():
    cfg = RolloutCorrectionConfig(rollout_rs="token_k1, seq_max_k3,token_k1", rollout_rs_threshold="0.5_2.0,0.01")
    assert cfg.rollout_rs == "token_k1,seq_max_k3"  # verl drops duplicates
    assert cfg.rejections() == (("token_k1", 0.5, 2.0), ("seq_max_k3", None, 0.01))
    one = RolloutCorrectionConfig(rollout_rs="seq_mean_k1", rollout_rs_threshold=1.25)  # lower = 1 / upper
    assert one.rejections() == (("seq_mean_k1", 0.8, 1.25),)
    assert not RolloutCorrectionConfig().corrects and RolloutCorrectionConfig().params()["rejections"] == ()


@pytest.mark.parametrize("overrides, message", [
    (["rl.algorithm.rollout_correction.rollout_rs=token_k1"], "needs rollout_rs_threshold"),
    (["rl.algorithm.rollout_correction.rollout_rs_threshold=2.0"], "without rollout_rs rejects nothing"),
    (["rl.algorithm.rollout_correction.rollout_rs=token_k4", "rl.algorithm.rollout_correction.rollout_rs_threshold=2"],
     "unknown criteria ['token_k4']"),
    (["rl.algorithm.rollout_correction.rollout_rs=seq_max_k2",
      "rl.algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"], "takes one upper bound"),
    (["rl.algorithm.rollout_correction.rollout_rs=token_k1",
      "rl.algorithm.rollout_correction.rollout_rs_threshold=2.0_0.5"], "must be below the upper"),
    (["rl.algorithm.rollout_correction.loss_type=reinforce"], "applies only with bypass_mode"),
    (["rl.algorithm.rollout_correction.bypass_mode=true", "rl.algorithm.rollout_correction.rollout_is=token"],
     "would only be logged"),
    (["rl.algorithm.rollout_correction.bypass_mode=true", "rl.algorithm.rollout_correction.loss_type=reinforce"],
     "rl.actor.policy_loss=gpg"),
    (["rl.algorithm.rollout_correction.rollout_is=token", "rl.actor.policy_loss=kl_cov"], "is not supported"),
    (["rl.algorithm.rollout_correction.rollout_is_batch_normalize=true"], "needs weights"),
    # normalised per micro-batch, the update depended on the split (verl at least all-reduces over ranks)
    (["rl.algorithm.rollout_correction.bypass_mode=true", "rl.algorithm.rollout_correction.loss_type=reinforce",
      "rl.actor.policy_loss=gpg", "rl.algorithm.rollout_correction.rollout_is=token",
      "rl.algorithm.rollout_correction.rollout_is_batch_normalize=true"], "how a mini-batch is split"),
])
def test_bad_settings_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        load_config(None, overrides)


# ---- in the loop ------------------------------------------------------------------------------------------


def _batch():
    """Two sequences of two tokens, advantages [1, -2] each, old logprobs = rollout logprobs."""
    batch = build_batch([[5, 6]] * 2, [[7, 8]] * 2, [[-1.0, -2.0]] * 2, pad_token_id=0)
    batch.tensors["old_logprobs"] = batch.tensors["rollout_logprobs"].clone()
    batch.tensors["advantages"] = torch.tensor([[1.0, -2.0], [1.0, -2.0]])
    return batch


def _loss(cfg, batch, logprobs):
    model = lambda **kwargs: (logprobs, torch.zeros_like(logprobs))  # noqa: E731
    return actor_loss(model, batch, global_denominators(batch.response_mask), cfg, lambda x: x if isinstance(x, dict)
                      else {})


def test_off_leaves_the_batch_and_the_loss_unchanged():
    cfg = load_config(None, [])
    batch = _batch()
    batch.tensors["old_logprobs"] = batch.tensors["old_logprobs"] + 0.3  # a gap, which only the metrics see
    train, metrics = corrected_batch(batch, cfg.rl.algorithm.rollout_correction)
    assert train is batch and "rollout_corr/kl" in metrics and close(metrics["rollout_corr/kl"], -0.3)
    logprobs = batch.tensors["old_logprobs"] + 0.1
    loss, _ = _loss(cfg, train, logprobs)
    t = batch.tensors
    plain, _ = POLICY_LOSSES.get("vanilla")(t["old_logprobs"], logprobs, t["advantages"], batch.response_mask,
                                            clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert torch.equal(loss, plain)


def test_weights_multiply_each_tokens_policy_loss():
    cfg = load_config(None, ["rl.algorithm.rollout_correction.rollout_is=token"])
    batch = _batch()
    batch.tensors["rollout_is_weights"] = torch.tensor([[1.5, 0.5], [1.0, 2.0]])
    logprobs = batch.tensors["old_logprobs"] + torch.tensor([[math.log(1.5), 0.0], [0.0, 0.0]])
    loss, metrics = _loss(cfg, batch, logprobs)
    # PPO-clip, eps 0.2: token (0,0) r = 1.5, A = 1: max(-1.5, -1.2) = -1.2; the others r = 1: -A = [2 | -1, 2]
    # weighted: [-1.2 * 1.5, 2 * 0.5 | -1 * 1, 2 * 2] = [-1.8, 1.0, -1.0, 4.0]; token mean 2.2 / 4 = 0.55
    assert close(loss, 0.55)
    assert close(metrics["actor/pg_clipfrac"], 0.25)  # the weights do not change which tokens clip


def test_rejected_tokens_leave_the_loss_and_its_denominator():
    cfg = load_config(None, ["rl.algorithm.rollout_correction.rollout_rs=token_k1",
                             "rl.algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"])
    batch = _batch()
    batch.tensors["old_logprobs"][0, 1] += 1.0  # ratio e = 2.72 > 2: rejected
    train, metrics = corrected_batch(batch, cfg.rl.algorithm.rollout_correction)
    assert train.response_mask.tolist() == [[True, False], [True, True]] and batch.response_mask.all()
    assert close(metrics["rollout_corr/rollout_rs_masked_fraction"], 0.25)
    loss, _ = _loss(cfg, train, train.tensors["old_logprobs"])
    # ratio 1 everywhere: -A on the kept tokens [-1 | -1, 2], mean over 3 tokens = 0
    assert close(loss, 0.0)


def test_bypass_corrects_against_the_current_policy_in_the_actor():
    cfg = load_config(None, ["rl.actor.policy_loss=gpg", "rl.algorithm.rollout_correction.bypass_mode=true",
                             "rl.algorithm.rollout_correction.loss_type=reinforce",
                             "rl.algorithm.rollout_correction.rollout_is=token",
                             "rl.algorithm.rollout_correction.rollout_is_threshold=2.0"])
    corr = cfg.rl.algorithm.rollout_correction
    batch = _batch()
    batch.tensors["old_logprobs"] = batch.tensors["rollout_logprobs"]  # what the loop does in bypass mode
    assert corrected_batch(batch, corr) == (batch, {})  # the driver leaves it to the actor
    logprobs = batch.tensors["rollout_logprobs"] + torch.tensor([[math.log(3.0), 0.0], [math.log(0.5), 0.0]])
    loss, metrics = _loss(cfg, batch, logprobs)
    # w = min(pi / pi_rollout, 2) = [2, 1 | 0.5, 1]; REINFORCE -w A log pi with log pi = [-1 + ln 3, -2 | -1 - ln 2, -2]
    # = [-2 (ln 3 - 1), 1 * 2 * (-2) | -0.5 (-1 - ln 2), 2 * (-2)] -> token mean
    terms = [-2 * (LN3 - 1), 2 * -2.0, -0.5 * (-1 - LN2), 2 * -2.0]
    assert close(loss, sum(terms) / 4, 1e-5)
    assert close(metrics["rollout_corr/rollout_is_mean"], (3 + 1 + 0.5 + 1) / 4, 1e-5)
    assert close(metrics["rollout_corr/kl"], -(LN3 - LN2) / 4, 1e-5)  # mean(log pi_rollout - log pi)


@pytest.mark.parametrize("name", ["vanilla", "gpg", "cispo", "gspo"])
def test_weighted_advantages_weight_each_tokens_loss(name):
    """w * A in the policy loss == w * (the token's loss), summed: per-token losses read with one-token masks
    (gspo: its ratio is per sequence, so per-sequence weights and one-sequence masks)."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 4, generator=g, dtype=torch.float64)
    logprobs = old + 0.4 * torch.randn(3, 4, generator=g, dtype=torch.float64)  # some ratios clip
    advantages = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.bool)
    weights = torch.rand(3, 4, generator=g, dtype=torch.float64) * 2 + 0.01
    mode = "token-mean"
    units = [(b, t) for b in range(3) for t in range(4)]
    if name == "gspo":
        weights, mode, units = weights[:, :1].expand(3, 4), "seq-mean-token-mean", [(b, None) for b in range(3)]
    fn = POLICY_LOSSES.get(name)
    kwargs = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}
    weighted, _ = fn(old, logprobs, advantages * weights, mask, mode, **kwargs)
    expected = 0.0
    for b, t in units:
        one = torch.zeros_like(mask)
        one[b, slice(None) if t is None else t] = True
        unit_loss, _ = fn(old, logprobs, advantages, one, mode, **kwargs)
        expected += float(weights[b, 0 if t is None else t]) * float(unit_loss)
    assert close(weighted, expected / len(units), 1e-12)
