"""Masked reductions and agg_loss: hand values, global denominators, micro-batch and mask invariance."""

import math

import pytest
import torch

from stages.core import LOSS_AGG_MODES, agg_loss, loss_denominators, masked_mean, masked_sum, masked_var, masked_whiten

F64 = torch.float64
ATOL = 1e-10


def _t(rows):
    return torch.tensor(rows, dtype=F64)


def _m(rows):
    return torch.tensor(rows, dtype=torch.bool)


# Shared batch: 2 sequences of valid length 3 and 2 (T = 4); the 1e6 entries sit under the mask.
LOSS = _t([[1.0, 2.0, 3.0, 1e6], [5.0, 6.0, 1e6, 1e6]])
MASK = _m([[1, 1, 1, 0], [1, 1, 0, 0]])


def test_masked_sum_mean():
    assert masked_sum(LOSS, MASK).item() == 17.0  # 1+2+3+5+6
    torch.testing.assert_close(masked_sum(LOSS, MASK, dim=-1), _t([6.0, 11.0]))
    torch.testing.assert_close(masked_mean(LOSS, MASK), torch.tensor(17 / 5, dtype=F64))
    torch.testing.assert_close(masked_mean(LOSS, MASK, dim=-1), _t([2.0, 5.5]))  # 6/3, 11/2
    # nothing valid: 0, not NaN
    assert masked_mean(LOSS, torch.zeros_like(MASK)).item() == 0.0


def test_masked_var_and_whiten():
    values, mask = _t([1.0, 2.0, 3.0, 1e6]), _m([1, 1, 1, 0])
    # mean 2; squared deviations 1, 0, 1 -> biased 2/3, unbiased 2/2 = 1
    torch.testing.assert_close(masked_var(values, mask, unbiased=False), torch.tensor(2 / 3, dtype=F64))
    torch.testing.assert_close(masked_var(values, mask), torch.tensor(1.0, dtype=F64))
    white = masked_whiten(values, mask)
    torch.testing.assert_close(white[:3], _t([-1.0, 0.0, 1.0]) / math.sqrt(1 + 1e-8), atol=ATOL, rtol=0)
    # shift_mean=False adds the mean (2) back
    torch.testing.assert_close(masked_whiten(values, mask, shift_mean=False)[:3], white[:3] + 2.0)
    # a single valid element: variance 0 (verl raises), whitened value 0
    assert masked_var(values, _m([0, 1, 0, 0])).item() == 0.0


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 17 / 5),  # (1+2+3+5+6) / 5 tokens = 3.4
        ("seq-mean-token-sum", (6 + 11) / 2),  # seq sums 6, 11 -> 8.5
        ("seq-mean-token-mean", (6 / 3 + 11 / 2) / 2),  # seq means 2, 5.5 -> 3.75
        ("seq-mean-token-sum-norm", (6 + 11) / (2 * 4)),  # 17 / (2 seqs * T_max 4) = 2.125
    ],
)
def test_agg_loss_local(mode, expected):
    torch.testing.assert_close(agg_loss(LOSS, MASK, mode), torch.tensor(expected, dtype=F64), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {"global_num_tokens": 10}, 17 / 10),
        ("seq-mean-token-sum", {"global_num_seqs": 4}, 17 / 4),
        ("seq-mean-token-mean", {"global_num_seqs": 4}, 7.5 / 4),  # (2 + 5.5) / 4
        ("seq-mean-token-sum-norm", {"global_num_seqs": 4, "max_response_length": 10}, 17 / 40),
        ("seq-mean-token-sum-norm", {"max_response_length": 10}, 17 / 20),  # local 2 seqs * 10
    ],
)
def test_agg_loss_global_denominators(mode, kwargs, expected):
    loss = agg_loss(LOSS, MASK, mode, **kwargs)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=F64), atol=ATOL, rtol=0)


def test_agg_loss_fully_masked_row_not_counted_as_sequence():
    loss = torch.cat([LOSS, _t([[7.0, 7.0, 7.0, 7.0]])])
    mask = torch.cat([MASK, _m([[0, 0, 0, 0]])])
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(17 / 2, abs=ATOL)  # not 17/3
    assert loss_denominators(mask) == {"global_num_tokens": 5, "global_num_seqs": 2}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_all_masked_mini_batch_with_global_denominators_is_zero(mode):
    """A mini-batch with no valid token (e.g. rollout correction rejected every row) gives the trainer global
    counts of 0: the loss is 0 (masked sum 0 / clamped count 1) with a zero gradient, as the local path, not
    0 / 0 = NaN."""
    empty = torch.zeros_like(MASK)
    denominators = loss_denominators(empty)  # {"global_num_tokens": 0, "global_num_seqs": 0}
    for counts in (denominators, {k: int(v) for k, v in denominators.items()}):  # tensors, Python ints
        leaf = LOSS.clone().requires_grad_(True)
        loss = agg_loss(leaf, empty, mode, **counts, max_response_length=4)
        loss.backward()
        assert loss.item() == 0.0
        assert (leaf.grad == 0).all()


def test_agg_loss_unknown_mode_lists_modes():
    modes = "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm"
    with pytest.raises(ValueError, match=f"loss_agg_mode='seq-sum' is not supported; use one of {modes}"):
        agg_loss(LOSS, MASK, "seq-sum")


def _random_batch(seed, batch=7, length=5):
    gen = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(batch, length, dtype=F64, generator=gen)
    lengths = torch.tensor([5, 1, 3, 0, 4, 2, 5])[:batch]  # includes an empty row
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return loss_mat, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_with_global_denominators_sum_to_full_batch(mode):
    loss_mat, mask = _random_batch(0)
    full_leaf = loss_mat.clone().requires_grad_(True)
    full = agg_loss(full_leaf, mask, mode)
    full.backward()

    micro_leaf = loss_mat.clone().requires_grad_(True)
    denominators = loss_denominators(mask) | {"max_response_length": mask.shape[-1]}
    total = sum(
        agg_loss(micro_leaf[idx], mask[idx], mode, **denominators)
        for idx in (slice(0, 2), slice(2, 5), slice(5, 7))  # uneven split 2 + 3 + 2
    )
    total.backward()
    torch.testing.assert_close(total, full, atol=1e-12, rtol=0)
    torch.testing.assert_close(micro_leaf.grad, full_leaf.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_without_global_denominators_differ(mode):
    """The test above can fail: local denominators do not give the full-batch loss."""
    loss_mat, mask = _random_batch(0)
    full = agg_loss(loss_mat, mask, mode)
    total = sum(agg_loss(loss_mat[i : i + 2], mask[i : i + 2], mode) for i in (0, 2, 4, 6))
    assert not torch.isclose(total, full)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_values_under_mask_do_not_matter(mode):
    loss_mat, mask = _random_batch(1)
    clean = loss_mat.clone().requires_grad_(True)
    dirty = torch.where(mask, loss_mat, torch.full_like(loss_mat, 1e6)).requires_grad_(True)
    agg_loss(clean, mask, mode).backward()
    loss_dirty = agg_loss(dirty, mask, mode)
    loss_dirty.backward()
    torch.testing.assert_close(loss_dirty, agg_loss(loss_mat, mask, mode), atol=0, rtol=0)
    torch.testing.assert_close(dirty.grad, clean.grad, atol=0, rtol=0)
    assert (dirty.grad[~mask] == 0).all()
