"""DAPO dynamic sampling's filter (stages.rl_data.varied_rows): which groups carry a learning signal."""

from __future__ import annotations

import math

from stages.rl_data import varied_rows

NAN = math.nan


def test_keeps_the_groups_whose_metric_varies():
    groups = ["a", "a", "b", "b", "c", "c"]
    assert varied_rows(groups, [1.0, 1.0, 0.0, 1.0, 0.0, 0.0], [0.0] * 6) == [2, 3]


def test_a_nan_metric_does_not_make_a_group_look_varied():
    # b: one sample's reward timed out (no acc), the others agree; c: no sample has an acc and the scores agree
    groups = ["a", "a", "a", "b", "b", "b", "c", "c"]
    metric = [0.0, 1.0, NAN, 0.0, 0.0, NAN, NAN, NAN]
    scores = [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert varied_rows(groups, metric, scores) == [0, 1, 2]


def test_a_group_without_any_metric_is_judged_by_its_scores():
    # a data source whose reward returns a plain float, beside one that returns {"score", "acc"}
    groups = ["a", "a", "b", "b"]
    assert varied_rows(groups, [NAN, NAN, NAN, NAN], [0.0, 0.5, 1.0, 1.0]) == [0, 1]


def test_single_sample_groups_are_kept_as_in_verl():
    # with rollout.n=1 no group can vary; dropping them all would stall the step until max_num_gen_batches
    assert varied_rows(["a", "b", "c"], [1.0, 0.0, NAN], [1.0, 0.0, 0.0]) == [0, 1, 2]


def test_rounding_hides_float_noise_not_real_differences():
    assert varied_rows(["a", "a", "b", "b"], [0.1 + 0.2, 0.3, 0.5, 0.5001], [0.0] * 4) == [2, 3]
