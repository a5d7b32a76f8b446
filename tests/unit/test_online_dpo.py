"""Online DPO (issue 15): the loss by hand, its gradient, mask holes, micro-batch invariance; the pairing; the
pair layout through micro-batches, rank balancing and the driver's pair batch; the config's checks."""

from __future__ import annotations

import math

import pytest
import torch

from infra.config import ConfigError, load_config
from infra.trainer_config import TrainerConfig
from stages.batch import balance_batch, build_batch, rank_rows
from stages.core import compute_advantages, dpo_loss, pair_order, preference_pairs
from stages.core.estimators import AdvantageInputs
from stages.rl_data import preference_batch
from stages.workers.actor_loss import actor_loss
from stages.workers.train_engine import MetricMeans, global_denominators, micro_batches

F64 = torch.float64
ATOL = 1e-12


def _t(rows):
    return torch.tensor(rows, dtype=F64)


def _close(actual, expected, atol=ATOL):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), atol=atol,
                               rtol=0)


# Two pairs, rows [chosen_0, rejected_0, chosen_1, rejected_1]; 99, 50, 7, 9, 5: values under the mask.
LOGPROBS = _t([[-1.0, -2.0, 7.0], [-2.0, 99.0, -1.0], [-0.2, -0.3, -0.5], [-0.4, 5.0, 5.0]])
REF = _t([[-1.5, -2.5, 9.0], [-1.0, -50.0, -1.0], [0.0, -0.1, -0.5], [-1.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)  # row 1: a multi-turn hole
BETA = 0.5


def test_dpo_loss_by_hand():
    leaf = LOGPROBS.clone().requires_grad_(True)
    loss, metrics = dpo_loss(leaf, REF, MASK, beta=BETA)
    # sequence log ratios sum_t (log pi - log pi_ref) over mask-1 tokens:
    #   chosen_0  : 0.5 + 0.5 = 1.0                 rejected_0: (-2 + 1) + (-1 + 1) = -1.0 (the hole skipped)
    #   chosen_1  : -0.2 - 0.2 + 0 = -0.4           rejected_1: -0.4 + 1 = 0.6
    # implicit rewards beta * ratio: 0.5, -0.5 | -0.2, 0.3;  margins: 1.0 | -0.5
    # losses: -log sigmoid(1.0) = log(1 + e^-1) = 0.3132617;  -log sigmoid(-0.5) = log(1 + e^0.5) = 0.9740770
    # mean over the 2 pairs: (0.3132617 + 0.9740770) / 2 = 0.6436693
    _close(loss, (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(0.5))) / 2)
    _close(loss, 0.6436693358, atol=1e-9)
    _close(metrics["dpo/rewards/chosen"], (0.5 - 0.2) / 2)  # 0.15
    _close(metrics["dpo/rewards/rejected"], (-0.5 + 0.3) / 2)  # -0.1
    _close(metrics["dpo/rewards/margins"], (1.0 - 0.5) / 2)  # 0.25
    _close(metrics["dpo/rewards/accuracies"], 0.5)  # pair 0 right, pair 1 wrong
    _close(metrics["dpo/logps/chosen"], (-3.0 - 1.0) / 2)  # sum log pi: -3.0 | -1.0
    _close(metrics["dpo/logps/rejected"], (-3.0 - 0.4) / 2)  # -3.0 | -0.4
    loss.backward()
    # d loss / d log pi = -(beta / P) sigmoid(-margin) on the chosen's valid tokens, + the same on the rejected's:
    #   pair 0: 0.25 * sigmoid(-1) = 0.0672354;  pair 1: 0.25 * sigmoid(0.5) = 0.1556148
    g0, g1 = 0.25 / (1 + math.exp(1.0)), 0.25 / (1 + math.exp(-0.5))
    _close(leaf.grad, [[-g0, -g0, 0.0], [g0, 0.0, g0], [-g1, -g1, -g1], [g1, 0.0, 0.0]])
    _close(leaf.grad[0, 0], -0.0672353553, atol=1e-9)


def test_a_descent_step_prefers_the_chosen_response():
    leaf = LOGPROBS.clone().requires_grad_(True)
    loss, metrics = dpo_loss(leaf, REF, MASK, beta=BETA)
    loss.backward()
    assert (leaf.grad[0::2][MASK[0::2]] < 0).all() and (leaf.grad[1::2][MASK[1::2]] > 0).all()
    stepped = (LOGPROBS - 0.5 * leaf.grad).detach()  # gradient descent raises log pi(chosen), lowers log pi(rejected)
    after, after_metrics = dpo_loss(stepped, REF, MASK, beta=BETA)
    assert after < loss and after_metrics["dpo/rewards/margins"] > metrics["dpo/rewards/margins"]


def test_values_under_the_mask_do_not_matter():
    clean = LOGPROBS.clone().requires_grad_(True)
    loss, metrics = dpo_loss(clean, REF, MASK, beta=BETA)
    loss.backward()
    for fill in (1e6, float("nan"), float("inf")):
        dirty = torch.where(MASK, LOGPROBS, fill).requires_grad_(True)
        dirty_loss, dirty_metrics = dpo_loss(dirty, torch.where(MASK, REF, -fill), MASK, beta=BETA)
        dirty_loss.backward()
        _close(dirty_loss, loss)
        _close(dirty.grad, clean.grad)
        for key in metrics:
            _close(dirty_metrics[key], metrics[key])


def _random_pairs(seed: int, num_pairs: int = 5, length: int = 6):
    gen = torch.Generator().manual_seed(seed)
    ref = -torch.rand(2 * num_pairs, length, dtype=F64, generator=gen) * 3
    logprobs = ref + 0.3 * torch.randn(ref.shape, dtype=F64, generator=gen)
    mask = torch.rand(ref.shape, generator=gen) < 0.7
    mask[:, 0] = True  # every response has a model token
    return logprobs, ref, mask


def test_micro_batches_give_the_mini_batch_loss_and_gradient():
    logprobs, ref, mask = _random_pairs(0)
    full = logprobs.clone().requires_grad_(True)
    full_loss, _ = dpo_loss(full, ref, mask, beta=0.1)
    full_loss.backward()
    split = logprobs.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 8), slice(8, 10)):  # uneven: 1 + 3 + 1 pairs
        loss, _ = dpo_loss(split[rows], ref[rows], mask[rows], beta=0.1, global_num_pairs=5)
        total = total + loss
    total.backward()
    _close(total, full_loss)
    _close(split.grad, full.grad)


def test_a_split_pair_is_an_error():
    with pytest.raises(ValueError, match="3 rows cannot be"):
        dpo_loss(LOGPROBS[:3], REF[:3], MASK[:3], beta=BETA)


def test_actor_metrics_are_pair_means_whatever_the_micro_batches():
    """The actor's loss and metrics through TrainEngine's token-weighted means equal the mini-batch's pair means."""
    logprobs, ref, mask = _random_pairs(1)
    batch = build_batch([[5, 6]] * 10, [[7] * 6] * 10, [[-1.0] * 6] * 10, pad_token_id=0,
                        response_masks=mask.long().tolist())
    batch.tensors.update(ref_logprobs=ref, policy=logprobs)  # `policy`: what the stand-in model returns
    cfg = load_config(None, ["rl.algorithm.adv_estimator=online_dpo", "rl.algorithm.adv_estimator.beta=0.1"])
    model = lambda rows, **kwargs: (rows, torch.zeros_like(rows))  # noqa: E731
    to_device = lambda x: x if isinstance(x, dict) else {"rows": x.tensors["policy"]}  # noqa: E731
    denominators = global_denominators(batch.response_mask)
    expected_loss, expected = dpo_loss(logprobs, ref, mask, beta=0.1)
    means, total = MetricMeans(), 0.0
    for rows in ([0, 1], [2, 3, 4, 5, 6, 7], [8, 9]):
        micro = batch.select(rows)
        loss, metrics = actor_loss(model, micro, denominators, cfg, to_device)
        total = total + loss
        means.add(metrics, weight=float(micro.response_mask.sum()))
    result = means.result()
    _close(total, expected_loss)
    _close(result["actor/dpo_loss"], expected_loss)
    for key, value in expected.items():
        _close(result[key], value)
    assert "actor/pg_loss" not in result


# ---- pairing -----------------------------------------------------------------------------------------------


def test_pairs_by_hand_ties_and_groups_without_preference():
    index = ["a", "b", "a", "c", "a", "b", "c", "d", "e", "e", "e", "e"]
    scores = _t([0.0, 1.0, 1.0, 2.0, 1.0, 1.0, 2.0 + 5e-7, 3.0, 1.0, 1.0, 0.0, 0.0])
    pairs = preference_pairs(scores, index)
    # a: rows 0, 2, 4 score 0, 1, 1 -> best row 2 (first of the tie 2, 4), worst row 0
    # b: rows 1, 5 both 1           -> no preference
    # c: rows 3, 6 differ by 5e-7   -> no preference (<= min_margin 1e-6), though row 6 is the higher
    # d: row 7 alone                -> no preference
    # e: rows 8-11 score 1, 1, 0, 0 -> best row 8, worst row 10 (first rows of the ties)
    assert pairs.chosen.tolist() == [2, 1, 6, 7, 8]
    assert pairs.rejected.tolist() == [0, 1, 3, 7, 10]
    assert pairs.preferred.tolist() == [True, False, False, False, True]
    assert pair_order(pairs).tolist() == [2, 0, 8, 10]


def test_online_dpo_labels_mark_the_pairs():
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    rewards = torch.zeros(5, 3, dtype=F64)
    rewards[0, 1], rewards[1, 2], rewards[2, 0] = 1.0, 0.5, 0.5  # sequence rewards 1, 0.5, 0.5 | 0, 0
    inputs = AdvantageInputs(torch.where(mask, rewards, 1e6), mask, index=["g", "g", "g", "h", "h"])
    advantages, returns = compute_advantages("online_dpo", inputs)
    # g: chosen row 0 (+1), rejected row 1 (-1; the first of the tie 1, 2), row 2: 0;  h: all equal -> 0
    labels = torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0], dtype=F64)
    _close(advantages, torch.where(mask, labels[:, None], 0.0))
    _close(returns, advantages)


# ---- the pair layout through the loop ----------------------------------------------------------------------


def _pair_batch(lengths: list[int]):
    batch = build_batch([[1, 2]] * len(lengths), [[3] * n for n in lengths], [[-1.0] * n for n in lengths], 0)
    batch.meta["row"] = list(range(len(lengths)))
    return batch


def _whole_pairs(rows: list[int]) -> bool:
    return len(rows) % 2 == 0 and all(rows[i] % 2 == 0 and rows[i + 1] == rows[i] + 1 for i in range(0, len(rows), 2))


@pytest.mark.parametrize("dynamic", [False, True])
def test_micro_batches_keep_pairs_together(dynamic):
    batch = _pair_batch([9, 1, 2, 8, 3, 3, 7, 1, 5, 5, 1, 9])
    cfg = TrainerConfig(micro_batch_size=4, use_dynamic_bsz=dynamic, max_token_len_per_device=20)
    groups = micro_batches(batch, cfg, unit_rows=2)
    assert sorted(r for g in groups for r in g) == list(range(12)) and all(_whole_pairs(g) for g in groups)
    if not dynamic:
        assert groups == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_balance_batch_moves_pairs_as_units():
    batch = _pair_batch([9, 9, 1, 1, 8, 8, 1, 2, 7, 6, 1, 1, 2, 2, 1, 1])  # 8 pairs, mini-batches of 8 rows
    balanced, metrics = balance_batch(batch, num_ranks=2, mini_rows=8, unit_rows=2)
    assert metrics["global_seqlen/balanced_max"] < metrics["global_seqlen/max"]
    order = balanced.meta["row"]
    assert sorted(order[:8]) == list(range(8)) and sorted(order[8:]) == list(range(8, 16))  # within mini-batches
    for shard in rank_rows(16, 2, 8):
        assert _whole_pairs([order[i] for i in shard])


def test_preference_batch_lays_out_pairs_and_counts_them():
    batch = _pair_batch([2] * 12)
    scores = [0.0, 1.0, 0.5, 1.0, 1.0, 1.0, 0.0, 0.0, 2.0, 1.0, 0.0, 3.0]
    batch.tensors["token_level_rewards"] = torch.tensor([[0.0, s] for s in scores])
    batch.meta["group_id"] = [g for g in "ppqqrrsstttu"]
    pairs, metrics = preference_batch(batch, num_ranks=1)
    # p = rows 0, 1 (0, 1) -> (1, 0); q = rows 2, 3 (0.5, 1) -> (3, 2); r = rows 4, 5 (1, 1) and s = rows 6, 7
    # (0, 0): no preference; t = rows 8-10 (2, 1, 0) -> (8, 10); u = row 11 alone: none. 3 pairs of 6 groups
    assert pairs.meta["row"] == [1, 0, 3, 2, 8, 10]
    assert metrics == {"dpo/num_pairs": 3.0, "dpo/num_pairs_dropped": 0.0, "dpo/frac_groups_paired": 3 / 6}
    two, metrics = preference_batch(batch, num_ranks=2)  # whole pairs for 2 workers: the third is left out
    assert two.meta["row"] == [1, 0, 3, 2] and metrics["dpo/num_pairs_dropped"] == 1.0


# ---- config ------------------------------------------------------------------------------------------------


def test_online_dpo_config_declares_the_reference_and_pairs():
    cfg = load_config(None, ["rl.algorithm.adv_estimator.beta=0.2", "rl.algorithm.adv_estimator=online_dpo"])
    estimator = cfg.rl.algorithm.adv_estimator
    assert estimator.beta == 0.2 and estimator.pairwise and cfg.rl.uses_reference and not cfg.rl.uses_critic
    assert cfg.rl.train_rows_per_prompt == 2 and estimator.params() == {}
    assert load_config(None, ["rl.algorithm.adv_estimator=online_dpo"]).rl.algorithm.adv_estimator.beta == 0.1
    assert not load_config(None, []).rl.uses_reference


@pytest.mark.parametrize("override, message", [
    ("rl.rollout.n=1", "rl.rollout.n=1 must be at least 2"),
    ("rl.actor.micro_batch_size=3", "rl.actor.micro_batch_size=3 must be even"),
    ("rl.actor.policy_loss=gspo", "rl.actor.policy_loss=gspo would be ignored"),
    ("rl.algorithm.use_kl_in_reward=true", "use_kl_in_reward=true would change the ranking"),
    ("rl.algorithm.adv_estimator.beta=0", "greater than 0"),
    ("rl.algorithm.rollout_correction.rollout_is=token", "rollout_correction (weights, rejection, bypass) would be"),
    ("ray.num_devices_per_node=8", "ppo_mini_batch_size=12 (pairs per mini-batch) must be divisible by the number of "
                                   "workers, 8"),
])
def test_online_dpo_config_errors_name_the_fix(override, message):
    base = ["rl.algorithm.adv_estimator=online_dpo", "rl.enabled=true", "rl.train_batch_size=24",
            "rl.actor.ppo_mini_batch_size=12", "rl.rollout.n=6"]
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        load_config(None, base + [override])
