"""Learning-signal diagnostics (infra.learning_signal): group shares by hand, the warning's streak logic, and
the text the report rebuilds from logged metrics."""

from __future__ import annotations

import pytest

from infra.learning_signal import (
    ALL_CORRECT,
    ALL_WRONG,
    WARNING_METRIC,
    ZERO_STD,
    NoSignalMonitor,
    group_signal_metrics,
    warnings_from_metrics,
)


def test_group_shares_by_hand():
    # 4 groups of 2: a all wrong (0, 0), b all right (1, 1), c mixed (1, 0), d equal partial credit (0.5, 0.5)
    ids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    scores = [0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.5]
    m = group_signal_metrics(ids, scores, scores)
    assert m[ZERO_STD] == 3 / 4  # a, b, d
    assert m[ALL_WRONG] == 1 / 4 and m[ALL_CORRECT] == 1 / 4  # d is neither
    assert m["train/pass@2"] == 2 / 4  # b, c
    assert m["train/mean@2"] == (0 + 1 + 0.5 + 0) / 4


def test_rewards_decide_zero_std_scores_decide_correctness():
    # equal scores but an overlong penalty on one sample: the rewards differ, so the group carries a signal
    m = group_signal_metrics(["a", "a"], [1.0, 0.7], [1.0, 1.0])
    assert m[ZERO_STD] == 0.0 and m["train/pass@2"] == 1.0


def test_mixed_group_sizes_say_k():
    m = group_signal_metrics(["a", "b", "b"], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0])
    assert m["train/pass@k"] == 0.5


def flat(step: int, frac: float = 1.0, wrong: float = 1.0) -> dict[str, float]:
    return {ZERO_STD: frac, ALL_WRONG: wrong, ALL_CORRECT: frac - wrong}


def test_monitor_warns_once_per_streak():
    monitor = NoSignalMonitor.create(min_frac=0.9, num_steps=3)
    fired = [monitor.update(s, flat(s)) is not None for s in range(1, 8)]
    assert fired == [False, False, True, False, False, False, False]
    assert monitor.update(8, flat(8, frac=0.5, wrong=0.5)) is None  # the streak ends
    fired = [monitor.update(s, flat(s)) is not None for s in range(9, 12)]
    assert fired == [False, False, True]


def test_monitor_below_threshold_never_warns_and_zero_steps_is_off():
    monitor = NoSignalMonitor.create(min_frac=0.9, num_steps=2)
    assert all(monitor.update(s, flat(s, frac=0.89, wrong=0.89)) is None for s in range(1, 10))
    off = NoSignalMonitor.create(min_frac=0.9, num_steps=0)
    assert all(off.update(s, flat(s)) is None for s in range(1, 10))


def test_monitor_state_survives_a_resume():
    monitor = NoSignalMonitor.create(0.9, 3)
    monitor.update(1, flat(1))
    monitor.update(2, flat(2))
    resumed = NoSignalMonitor.create(0.9, 3)
    resumed.load_state_dict(monitor.state_dict())
    assert resumed.update(3, flat(3)) is not None


@pytest.mark.parametrize("wrong, advice", [(0.95, "rl.rollout.n"), (0.0, "harder data")])
def test_text_says_what_was_seen_and_what_to_do(wrong, advice):
    monitor = NoSignalMonitor.create(0.9, 2)
    monitor.update(4, flat(4, 0.95, wrong))
    text = monitor.update(5, flat(5, 0.95, wrong))
    assert "steps 4-5" in text and "95% of the groups" in text and advice in text


def test_report_rebuilds_the_warning_from_metrics():
    monitor = NoSignalMonitor.create(0.9, 2)
    metrics: dict[str, list[tuple[int, float]]] = {ZERO_STD: [], ALL_WRONG: [], ALL_CORRECT: []}
    live = []
    for step in range(1, 5):
        m = flat(step)
        text = monitor.update(step, m)
        if text:
            live.append(text)
            metrics.setdefault(WARNING_METRIC, []).append((step, float(len(monitor.streak))))
        for k in (ZERO_STD, ALL_WRONG, ALL_CORRECT):
            metrics[k].append((step, m[k]))
    assert warnings_from_metrics(metrics) == live and len(live) == 1
    assert warnings_from_metrics({ZERO_STD: [(1, 1.0)]}) == []


def test_groups_of_one_sample_are_not_counted_as_without_signal():
    """rl.rollout.n=1 (recipes/gsm8k_ppo.yaml: GAE) made every group 'zero spread' and the warning said 100% of the
    groups had advantages 0 after three steps. One sample has no spread to lose: only groups of two or more count."""
    scores = [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    m = group_signal_metrics(["a", "b", "c", "c", "d", "d"], scores, scores)
    assert m[ZERO_STD] == 1 / 2 and m[ALL_CORRECT] == 1 / 2 and m[ALL_WRONG] == 0.0  # c of c, d
    assert m["train/pass@k"] == 3 / 4  # a, c, d: every group
    alone = group_signal_metrics(["a", "b"], [1.0, 0.0], [1.0, 0.0])
    assert ZERO_STD not in alone and alone["train/pass@1"] == 1 / 2
    monitor = NoSignalMonitor.create(0.9, 1)
    assert monitor.update(1, alone) is None


def test_the_estimators_that_the_warning_watches_are_those_whose_equal_groups_get_no_advantage():
    """The no-signal warning (only for `group_relative` estimators) says a group of equal rewards has advantages 0:
    that holds for exactly those estimators' math (prompt 0's 4 samples all rewarded 1, prompt 1's all 0)."""
    import torch

    from infra.algorithms import AdvEstimator, variant_names
    from infra.rl_config import RLConfig
    from stages.core.estimators import AdvantageInputs, compute_advantages

    rewards = torch.tensor([[0.0, 1.0]] * 4 + [[0.0, 0.0]] * 4)
    mask = torch.ones(8, 2, dtype=torch.bool)
    inputs = AdvantageInputs(rewards, mask, index=[0] * 4 + [1] * 4, values=torch.full((8, 2), 0.3),
                             reward_baselines=torch.zeros(8))
    for name in variant_names(AdvEstimator):
        estimator = RLConfig.model_validate({"algorithm": {"adv_estimator": name}}).algorithm.adv_estimator
        advantages, _ = compute_advantages(name, inputs)
        assert bool((advantages[:4] == 0).all()) == estimator.group_relative, name


def test_the_monitor_watches_group_relative_estimators_and_notes_groups_of_one():
    from infra.rl_config import RLConfig

    def monitor(estimator: str, n: int):
        rl = RLConfig.model_validate({"algorithm": {"adv_estimator": estimator}, "rollout": {"n": n}})
        return NoSignalMonitor.for_config(rl)

    grpo, note = monitor("grpo", 8)
    assert grpo.num_steps == 3 and note is None
    gae, note = monitor("gae", 1)  # recipes/gsm8k_ppo.yaml
    assert gae.num_steps == 0 and note is None
    assert all(gae.update(step, flat(step)) is None for step in range(1, 6))
    _, note = monitor("rloo", 1)
    assert note.startswith("rl.rollout.n=1 with rl.algorithm.adv_estimator=rloo: each group is one sample")
