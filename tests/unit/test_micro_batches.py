"""Micro-batches of the actor/critic updates: fixed rows, or a token budget balanced across the groups."""

from infra.trainer_config import ActorConfig
from stages.batch import build_batch
from stages.workers.train_engine import budget_count, micro_batches


def a_batch(lengths: list[int]):
    return build_batch([[5]] * len(lengths), [[7] * (n - 1) for n in lengths], [[0.0] * (n - 1) for n in lengths], 0)


def test_budget_count_fills_in_order_and_gives_long_rows_their_own():
    assert budget_count([5, 5, 5], 10) == 2
    assert budget_count([3, 8, 3], 10) == 3
    assert budget_count([12, 1], 10) == 2
    assert budget_count([], 10) == 0


def test_dynamic_micro_batches_are_balanced_not_a_small_remainder():
    lengths = [9, 9, 9, 9, 9, 9, 9, 9, 9, 2]  # in order: 4 groups of 18-20 tokens and a remainder of 2
    cfg = ActorConfig(use_dynamic_bsz=True, max_token_len_per_device=20)
    groups = micro_batches(a_batch(lengths), cfg)
    assert len(groups) == budget_count(lengths, 20) == 5
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
    totals = sorted(sum(lengths[r] for r in g) for g in groups)
    assert totals[0] >= 9 and totals[-1] <= 20  # no 2-token remainder; within the budget here


def test_fixed_micro_batches_keep_row_order():
    cfg = ActorConfig(micro_batch_size=3)
    assert micro_batches(a_batch([4] * 7), cfg) == [[0, 1, 2], [3, 4, 5], [6]]


def test_gradient_checkpointing_turns_on_when_the_training_state_fills_the_gpu():
    from stages.workers.train_engine import state_is_large

    h200 = 143_771 * 2**20
    assert state_is_large(7_615_616_512, 1, h200)  # 7B on one H200: 81% of it
    assert not state_is_large(3_085_938_688, 1, h200)  # 3B: 33%
    assert not state_is_large(7_615_616_512, 4, h200)  # 7B over 4 GPUs: 20% each
