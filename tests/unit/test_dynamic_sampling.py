"""DAPO dynamic sampling's filter (stages.rl_data.varied_rows): which groups carry a learning signal."""

from __future__ import annotations

import math

import torch

from stages.batch import build_batch
from stages.rl_data import concat_batches, trajectory_rows, varied_rows

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


def test_batches_whose_reward_components_differ_concatenate_one_value_per_sample():
    """Groups scored in separate calls (dynamic sampling's top-ups, the async modes' chunks): only one call's data
    source returned an `acc` beside its score. The key was extended by that batch's samples alone, so the rollouts
    table's rows raised IndexError after the step's update."""
    with_acc = scored([[5, 6], [7]], {"group_id": ["1-0"] * 2, "reward_acc": [1.0, 0.0], "response": ["a", "b"]})
    without = scored([[8, 9]], {"group_id": ["1-1"], "response": ["c"]})

    batch = concat_batches([without, with_acc], pad_token_id=0)

    assert batch.meta["group_id"] == ["1-1", "1-0", "1-0"] and batch.meta["response"] == ["c", "a", "b"]
    assert [str(v) for v in batch.meta["reward_acc"]] == ["nan", "1.0", "0.0"]
    rows = trajectory_rows(batch, ["p"] * 3, policy_version=0)
    assert [str(r["reward_acc"]) for r in rows] == ["nan", "1.0", "0.0"]


def scored(responses: list[list[int]], meta: dict):
    n = len(responses)
    base = {"sample_index": list(range(n)), "data_source": ["math"] * n, "ground_truth": ["4"] * n,
            "finish_reason": ["stop"] * n, "num_turns": [1] * n, "rollout_metrics": [{}] * n}
    batch = build_batch([[1, 2]] * n, responses, [[-0.5] * len(r) for r in responses], 0, {**base, **meta})
    batch.tensors["scores"] = batch.tensors["rewards"] = torch.ones(n)
    return batch


def test_top_ups_draw_prompts_the_step_has_not_had():
    """Each top-up drew a random batch of all prompts: with 32 of 256 a step's first top-up repeated ~4 of the step's
    own prompts (some just dropped for zero spread), trained as two groups. Now a step's draws are distinct until it
    has had every prompt, and the same on a resumed run."""
    from stages.rl_data import PromptSampler

    sampler = PromptSampler(256, 32, seed=3)
    for step in (1, 2, 9):
        draws = [sampler.indices(step, extra) for extra in range(8)]  # the step's batch and 7 top-ups: 256 prompts
        assert sorted(i for draw in draws for i in draw) == list(range(256)), step
        assert draws == [PromptSampler(256, 32, seed=3).indices(step, extra) for extra in range(8)]
    assert sampler.indices(1, 1) != sampler.indices(2, 1)
    again = sampler.indices(1, 8)  # past every prompt: from the start of the other prompts again
    assert again == sampler.indices(1, 1)
    small = PromptSampler(4, 4, seed=0)  # no prompt left outside the batch
    assert small.indices(1, 1) == small.indices(1)
