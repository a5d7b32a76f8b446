"""Masked reductions and loss aggregation over response tokens, with explicit global denominators.

Notation used in this package:
    B: sequences in the (micro-)batch.  T: response tokens per sequence (padded).  V: vocabulary size.
    response_mask / loss_mask: bool (B, T), True on valid response tokens (the model's own); a multi-turn
        response has holes (tool/user tokens False), and every reduction here only counts True entries.

Loss aggregation (verl's `agg_loss` modes), with N_tok the valid-token count, N_seq the count of sequences
that have at least one valid token, L_b the number of valid tokens of sequence b and T_max the max response
length (by default the padded width T, masked tool tokens included, as verl's `loss_mask.shape[-1]`):

    token-mean                 sum_{b,t} l[b,t]                 / N_tok
    seq-mean-token-sum         sum_b (sum_t l[b,t])             / N_seq
    seq-mean-token-mean        sum_b (sum_t l[b,t] / L_b)       / N_seq
    seq-mean-token-sum-norm    sum_b (sum_t l[b,t])             / (N_seq * T_max)   (Dr.GRPO's constant)

N_tok and N_seq are local counts unless `global_num_tokens` / `global_num_seqs` are given. The trainer
computes them once for the whole mini-batch (summed over data-parallel ranks; see `loss_denominators`) and
passes them to every micro-batch: then the micro-batch losses sum to exactly the mini-batch loss, and the
gradient does not depend on how the batch was split. If the data-parallel wrapper *averages* gradients
across ranks (DDP, FSDP), multiply the loss by the number of ranks, as verl does with `dp_size`.

Deviations from verl:
    * Masked positions are excluded with `torch.where`, not by multiplying with the mask, so non-finite
      garbage under the mask cannot leak into the result.
    * Empty denominators, local or global, are clamped to 1 (an all-masked batch gives 0, not NaN; verl
      divides by 0 when a given global count is 0), and the unbiased variance
      of a single valid element is 0 instead of raising: both avoid a host-device sync in `masked_var`.
    * seq-mean-token-sum-norm is a mean over sequences (Dr.GRPO's 1/G), divided by N_seq * T_max; verl divides
      each micro-batch's token sum by T_max alone (no sequence count), so its loss, and the learning rate that
      suits it, scale with the number of sequences per micro-batch.
"""

from __future__ import annotations

import torch

Count = int | float | torch.Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is True.

    Args:
        values: Any shape, e.g. (B, T).
        mask: bool, same shape as `values`.
        dim: Dimension to reduce; None reduces everything to a scalar.

    Returns:
        The masked sum, `values` reduced over `dim`.
    """
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    kept = torch.where(mask.bool(), values, zeros)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is True; 0 where nothing is valid.

    Args:
        values: Any shape, e.g. (B, T).
        mask: bool, same shape as `values`.
        dim: Dimension to reduce; None reduces everything to a scalar.

    Returns:
        The masked mean, `values` reduced over `dim`.
    """
    mask = mask.bool()
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of all valid entries (a scalar), with Bessel's correction when `unbiased`.

    Args:
        values: Any shape, e.g. (B, T).
        mask: bool, same shape as `values`.
        unbiased: Multiply by n / (n - 1), n the valid count, as verl does.

    Returns:
        Scalar variance; 0 when fewer than two entries are valid.
    """
    mask = mask.bool()
    centered = values - masked_mean(values, mask)
    variance = masked_mean(centered.square(), mask)
    if unbiased:
        count = mask.sum().to(values.dtype)
        variance = variance * count / (count - 1).clamp(min=1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardise `values` with the masked mean and (unbiased) masked variance of the valid entries.

    Args:
        values: Any shape, e.g. (B, T).
        mask: bool, same shape as `values`.
        shift_mean: If False, add the mean back after scaling (verl's option).

    Returns:
        `(values - mean) / sqrt(var + 1e-8)`, same shape as `values`; entries under the mask are not zeroed.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    return whitened if shift_mean else whitened + mean


def loss_denominators(response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Valid-token and non-empty-sequence counts of a mini-batch, for `agg_loss`'s global denominators.

    Call on the whole mini-batch before splitting it into micro-batches; under data parallelism, sum the
    result over ranks (an all-reduce, done by the worker, not here).

    Args:
        response_mask: bool (B, T).

    Returns:
        {"global_num_tokens": scalar, "global_num_seqs": scalar}, int64 tensors, ready to `**`-splat.
    """
    mask = response_mask.bool()
    return {"global_num_tokens": mask.sum(), "global_num_seqs": mask.any(dim=-1).sum()}


def _at_least_one(count: Count) -> Count:
    """`count` clamped below at 1: an empty (local or global) count divides a zero sum, giving 0, not NaN."""
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_length: int | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar (see the module docstring for the formula of each mode).

    Args:
        loss_mat: (B, T) per-token loss.
        loss_mask: bool (B, T); False entries never reach the result.
        loss_agg_mode: One of `LOSS_AGG_MODES`.
        global_num_tokens: Valid tokens of the whole mini-batch (all micro-batches, all ranks); `token-mean`
            divides by it. None: the local count.
        global_num_seqs: Non-empty sequences of the whole mini-batch; the `seq-mean-*` modes divide by it.
            None: the local count.
        max_response_length: T_max of `seq-mean-token-sum-norm`. None: `loss_mat.shape[-1]`; pass the
            configured maximum when micro-batches are padded to different lengths.

    Returns:
        Scalar loss.

    Raises:
        ValueError: Unknown `loss_agg_mode`.
    """
    mask = loss_mask.bool()
    if loss_agg_mode == "token-mean":
        denominator = mask.sum() if global_num_tokens is None else global_num_tokens
        return masked_sum(loss_mat, mask) / _at_least_one(denominator)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not supported; use one of {', '.join(LOSS_AGG_MODES)}")

    seq_losses = masked_sum(loss_mat, mask, dim=-1)  # (B,)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / mask.sum(dim=-1).clamp(min=1).to(loss_mat.dtype)
    num_seqs = mask.any(dim=-1).sum() if global_num_seqs is None else global_num_seqs
    loss = seq_losses.sum() / _at_least_one(num_seqs)  # fully masked rows contribute 0 to the sum
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mat.shape[-1] if max_response_length is None else max_response_length)
    return loss
