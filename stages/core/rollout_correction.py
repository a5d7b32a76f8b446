"""Rollout correction (verl's `rollout_corr_helper`): importance weights and rejection for the gap between the
policy that sampled the tokens (the rollout engine, pi_rollout) and the one the trainer scores them with (pi_old).

Notation: lr = log pi_old - log pi_rollout per valid token (the log ratio; 0 under the mask), r = exp(lr), C the
weight threshold, B = 20 the safety bound of every exponent (exp(+-20)), s_b = sum_t lr[b,t] (the sequence's log
ratio), m_b = s_b / L_b (its mean: the log of the geometric-mean ratio).

    weights   token:     w[b,t] = min(exp(clamp(lr[b,t], -B, B)), C)                   (TIS, per token)
              sequence:  w[b,t] = min(exp(clamp(s_b, -B, B)), C)  on every valid t      (Seq-TIS)
              optionally divided by their batch mean (tokens; sequences for `sequence`); 0 under the mask.
    rejection each criterion "<level>_<k>" computes a per-token divergence d[b,t] from lr (clamped to +-B):
                  k1 = -lr,  k2 = lr^2 / 2,  k3 = exp(lr) - 1 - lr
              and aggregates it per level: token (d itself), seq_sum (sum_t), seq_mean (mean_t), seq_max (max_t).
              k2/k3: keep where the statistic <= upper. k1: the statistic is -log of a ratio (token: r, seq_sum:
              prod_t r, seq_mean: the geometric mean of r); keep where lower <= ratio <= upper. A rejected token
              (token level) or sequence (other levels) leaves the mask; every criterion must pass.

The caller multiplies each token's policy-gradient loss by w before aggregation (verl's `pg_losses *
rollout_is_weights` in every policy loss) and aggregates over the returned mask. Weights are detached: they change
the measure, not the objective.

Metrics (verl's names, prefix `rollout_corr/`; detached scalars): `rollout_is_*` of the weights before truncation
(mean, max, min, std and effective sample size of the weights clamped to [1/C, C], ratio_fraction_high/low: share
above C / below 1/C, seq_* of each sequence's mean weight, batch_norm_factor), `rollout_rs_*` (masked_fraction:
share of valid tokens rejected, seq_masked_fraction: share of sequences with a rejected token; per criterion its
statistic's mean/max/min and both fractions), and the off-policy gap: kl = mean(log pi_rollout - log pi_old), k3_kl,
training_ppl / rollout_ppl (batch mean of each sequence's exp(-mean logprob)), their logs, log_ppl_diff (mean of
log ppl_training - log ppl_rollout per sequence) with abs/max/min, ppl_ratio, chi2_token = mean(r^2) - 1 and
chi2_seq = mean_b(exp(2 s_b)) - 1.

Deviations from verl:
    * k1 bounds apply to the ratio as verl's documentation states (lower <= r <= upper); verl's code compares -log r
      with [log lower, log upper], i.e. keeps 1/upper <= r <= 1/lower. The two agree for symmetric bounds
      (lower = 1/upper, e.g. 0.5_2.0, and the default when one value is given).
    * Per-sequence metrics (perplexities, seq fractions) average over sequences with a valid token (verl: all rows),
      k3_kl clamps lr to +-B as the weights do, and masked values never reach a result (`torch.where`).
    * No `.item()`: metrics stay tensors on the inputs' device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from stages.core.masked import masked_mean, masked_sum

SAFETY_BOUND = 20.0
RS_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
RS_DIVERGENCES = ("k1", "k2", "k3")
Rejection = tuple[str, float | None, float]  # (criterion, lower ratio bound for k1 else None, upper bound)


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rejections: Sequence[Rejection] = (),
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights, the mask after rejection, and the `rollout_corr/*` metrics.

    Args:
        old_logprobs: (B, T) log pi_old of the sampled tokens (the trainer's; in bypass mode the current policy's).
        rollout_logprobs: (B, T) log pi_rollout, the engine's logprobs of the same tokens.
        response_mask: bool (B, T), at least one True.
        rollout_is: "token", "sequence" or None (no weights).
        rollout_is_threshold: C, the truncation of the weights (> 0).
        rollout_is_batch_normalize: Divide the truncated weights by their mean (token: over valid tokens; sequence:
            over sequences), when that mean exceeds 1e-8.
        rejections: (criterion, lower, upper) triples; criterion "<level>_<k>" (see the module docstring), lower the
            k1 ratio bound (None for k2/k3).

    Returns:
        (weights or None, kept, metrics): weights (B, T) detached, 0 under the mask; kept bool (B, T), the
        mask with rejected tokens False (`response_mask` itself when nothing is rejected); metrics as above.

    Raises:
        ValueError: An unknown level or criterion, or shapes that differ.
    """
    if not old_logprobs.shape == rollout_logprobs.shape == response_mask.shape:
        raise ValueError(f"shapes differ: old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
                         f"{tuple(rollout_logprobs.shape)}, response_mask {tuple(response_mask.shape)}")
    mask = response_mask.bool()
    old, rollout = old_logprobs.detach().float(), rollout_logprobs.detach().float()
    log_ratio = torch.where(mask, old - rollout, 0.0)
    metrics = offpolicy_metrics(old, rollout, mask)
    weights = None
    if rollout_is is not None:
        weights, is_metrics = importance_weights(log_ratio, mask, rollout_is, rollout_is_threshold,
                                                 rollout_is_batch_normalize)
        metrics.update(is_metrics)
    kept = mask
    if rejections:
        kept, rs_metrics = rejection_mask(log_ratio, mask, rejections)
        metrics.update(rs_metrics)
    return weights, kept, {f"rollout_corr/{k}": v.detach() for k, v in metrics.items()}


def importance_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float, batch_normalize: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(B, T) truncated (optionally normalised) weights, 0 under the mask, and `rollout_is_*` metrics.

    Args:
        log_ratio: (B, T) lr, 0 under the mask.
        mask: bool (B, T).
        level: "token" or "sequence".
        threshold: C.
        batch_normalize: See `rollout_correction`.
    """
    rows = mask.any(-1)  # (B,) sequences with a valid token
    if level == "token":
        log_weights = log_ratio
    elif level == "sequence":
        log_weights = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)  # s_b on every token
    else:
        raise ValueError(f"rollout_is={level!r}: use token or sequence")
    raw = torch.where(mask, torch.exp(log_weights.clamp(-SAFETY_BOUND, SAFETY_BOUND)), 0.0)
    metrics = _weight_metrics(raw, log_weights, mask, rows, level, threshold)
    weights = raw.clamp(max=threshold)
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            mean = masked_mean(masked_mean(weights, mask, dim=-1), rows)  # one weight per sequence
        factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights.detach(), metrics


def _weight_metrics(raw, log_weights, mask, rows, level, threshold) -> dict[str, torch.Tensor]:
    """verl's `rollout_is_*` metrics of the untruncated weights `raw` (sequence level: extremes from the log)."""
    low = 1.0 / threshold
    if level == "sequence":  # in log space: the true extremes and exceedances, not the safety-bounded ones
        seq_log = log_weights[:, 0]
        high_share = masked_mean((seq_log > math.log(threshold)).float(), rows)
        low_share = masked_mean((seq_log < math.log(low)).float(), rows)
        largest = torch.exp(torch.where(rows, seq_log, -torch.inf).max().clamp(max=SAFETY_BOUND))
        smallest = torch.exp(torch.where(rows, seq_log, torch.inf).min())
    else:
        high_share, low_share = masked_mean((raw > threshold).float(), mask), masked_mean((raw < low).float(), mask)
        largest = torch.where(mask, raw, -torch.inf).max()
        smallest = torch.where(mask, raw, torch.inf).min()
    bounded = raw.clamp(low, threshold)
    bounded_mean = masked_mean(bounded, mask)
    std = (masked_mean(bounded.square(), mask) - bounded_mean.square()).clamp(min=0).sqrt()
    normalized = bounded / (bounded_mean + 1e-8)
    seq_mean = masked_mean(raw, mask, dim=-1)  # (B,)
    return {
        "rollout_is_mean": masked_mean(raw, mask), "rollout_is_max": largest, "rollout_is_min": smallest,
        "rollout_is_std": std, "rollout_is_eff_sample_size": 1.0 / masked_mean(normalized.square(), mask),
        "rollout_is_ratio_fraction_high": high_share, "rollout_is_ratio_fraction_low": low_share,
        **{f"rollout_is_seq_{k}": v for k, v in _row_stats(seq_mean, rows).items()},
        "rollout_is_seq_max_deviation": torch.where(rows, (seq_mean - 1.0).abs(), 0.0).max(),
        "rollout_is_seq_fraction_high": masked_mean((seq_mean > threshold).float(), rows),
        "rollout_is_seq_fraction_low": masked_mean((seq_mean < low).float(), rows),
    }


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, rejections: Sequence[Rejection]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """bool (B, T) mask of the tokens every criterion keeps, and `rollout_rs_*` metrics.

    Args:
        log_ratio: (B, T) lr, 0 under the mask.
        mask: bool (B, T).
        rejections: (criterion, lower, upper) triples (see `rollout_correction`).
    """
    rows = mask.any(-1)
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    divergences = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}  # (B, T) each
    kept = mask
    metrics: dict[str, torch.Tensor] = {}
    for criterion, lower, upper in rejections:
        level, _, k = criterion.rpartition("_")
        if level not in RS_LEVELS or k not in RS_DIVERGENCES or (level == "seq_max" and k == "k1"):
            raise ValueError(f"rejection criterion {criterion!r}: use <level>_<k> with level in {RS_LEVELS} and k in "
                             f"{RS_DIVERGENCES} (seq_max only with k2, k3)")
        stat = _aggregate(divergences[k], mask, level)  # (B, T) or (B, 1)
        if k == "k1":  # the statistic is -log(ratio): lower <= ratio <= upper
            passes = (-stat >= math.log(lower)) & (-stat <= math.log(upper))
        else:
            passes = stat <= upper
        passes = passes.expand_as(mask)
        stat = stat.expand_as(mask)
        rejected = mask & ~passes
        prefix = f"rollout_rs_{criterion}"
        metrics[f"{prefix}_masked_fraction"] = masked_mean(rejected.float(), mask)
        metrics[f"{prefix}_seq_masked_fraction"] = masked_mean(rejected.any(-1).float(), rows)
        metrics[f"{prefix}_mean"] = masked_mean(stat, mask)
        extremes = _row_stats(stat[:, 0], rows) if level != "token" else {
            "max": torch.where(mask, stat, -torch.inf).max(), "min": torch.where(mask, stat, torch.inf).min()}
        metrics[f"{prefix}_max"], metrics[f"{prefix}_min"] = extremes["max"], extremes["min"]
        kept = kept & passes
    rejected = mask & ~kept
    metrics["rollout_rs_masked_fraction"] = masked_mean(rejected.float(), mask)
    metrics["rollout_rs_seq_masked_fraction"] = masked_mean(rejected.any(-1).float(), rows)
    return kept, metrics


def _aggregate(divergence: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The per-token divergence (B, T) at `level`: itself, or (B, 1) per sequence (sum, mean or max over mask)."""
    if level == "token":
        return divergence
    if level == "seq_sum":
        return masked_sum(divergence, mask, dim=-1).unsqueeze(-1)
    if level == "seq_mean":
        return masked_mean(divergence, mask, dim=-1).unsqueeze(-1)
    largest = torch.where(mask, divergence, -torch.inf).max(-1, keepdim=True).values
    return torch.where(torch.isfinite(largest), largest, 0.0)  # an empty row: 0


def offpolicy_metrics(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """verl's off-policy diagnostics of pi_old ("training") against pi_rollout (see the module docstring)."""
    rows = mask.any(-1)
    log_ratio = torch.where(mask, old - rollout, 0.0).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    mean_old = masked_mean(old, mask, dim=-1)  # (B,) mean logprob per sequence
    mean_rollout = masked_mean(rollout, mask, dim=-1)
    log_ppl_diff = mean_rollout - mean_old  # = log ppl_training - log ppl_rollout
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    diff = _row_stats(log_ppl_diff, rows)
    return {
        "kl": masked_mean(rollout - old, mask),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1.0, mask),
        "training_ppl": masked_mean(torch.exp(-mean_old), rows),
        "training_log_ppl": masked_mean(-mean_old, rows),
        "rollout_ppl": masked_mean(torch.exp(-mean_rollout), rows),
        "rollout_log_ppl": masked_mean(-mean_rollout, rows),
        "log_ppl_diff": diff["mean"],
        "log_ppl_abs_diff": masked_mean(log_ppl_diff.abs(), rows),
        "log_ppl_diff_max": diff["max"],
        "log_ppl_diff_min": diff["min"],
        "ppl_ratio": masked_mean(torch.exp(log_ppl_diff), rows),
        "chi2_token": masked_mean(torch.exp(2.0 * log_ratio), mask) - 1.0,
        "chi2_seq": masked_mean(torch.exp(2.0 * seq_log_ratio), rows) - 1.0,
    }


def _row_stats(values: torch.Tensor, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """mean, std (unbiased; 0 for one row), max, min of (B,) `values` over the rows where `rows` is True."""
    mean = masked_mean(values, rows)
    count = rows.sum().to(values.dtype)
    var = masked_sum((values - mean).square(), rows) / (count - 1).clamp(min=1)
    return {"mean": mean, "std": var.sqrt(), "max": torch.where(rows, values, -torch.inf).max(),
            "min": torch.where(rows, values, torch.inf).min()}
