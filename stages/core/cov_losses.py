"""Clip-Cov and KL-Cov policy losses (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs",
arXiv 2505.22617), with verl's semantics.

Both rank valid tokens by the centred covariance term of log-probability and advantage,
    cov[b,t] = (A[b,t] - mean(A)) * (log pi[b,t] - mean(log pi))      (means over valid tokens, no gradient),
and treat the tokens with large covariance (the ones that drive entropy collapse) differently:

    clip_cov  Among tokens the PPO clip did not already clip and with clip_cov_lb < cov < clip_cov_ub, pick
              max(1, floor(clip_cov_ratio * N_tok)) at random and drop them from the gradient (their loss
              is multiplied by 0). Loss otherwise is PPO-clip max(-A r, -A clip(r)) without dual clip.
    kl_cov    The top max(1, floor(kl_cov_ratio * N_tok)) tokens by cov get a penalty ppo_kl_coef * |log r|
              added to the unclipped -A r; no clipping anywhere.

N_tok is the valid-token count of the micro-batch given, so (as in verl) the selection, and hence the loss,
depends on how a batch is split into micro-batches.

Deviations from verl:
    * Token selection runs on the device with a sort (no `.item()`, no host round-trip); clip_cov draws
      its random subset from `generator` when given, for reproducible tests.
    * The log-ratio is clamped to [-20, 20] before the exp, as verl does for `vanilla` (verl does not clamp
      here); it only matters for |log r| > 20.
    * kl_cov reports `actor/pg_clipfrac` = share of KL-penalised tokens and `actor/ppo_kl` = mean of
      old - new log-prob (verl: 0 and mean |log r|); mean |log r| is reported as `actor/ppo_kl_abs`.
"""

from __future__ import annotations

import torch

from stages.core.masked import Count, agg_loss, masked_mean
from stages.core.policy_loss import LOG_RATIO_CLAMP, POLICY_LOSSES, masked_log_ratio, pg_metrics


def logprob_advantage_cov(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) centred covariance term (A - mean A) * (log pi - mean log pi), detached, -inf under the mask."""
    logprobs = logprobs.detach()
    advantages = advantages.detach()
    cov = (advantages - masked_mean(advantages, mask)) * (logprobs - masked_mean(logprobs, mask))
    return torch.where(mask, cov, -torch.inf)


def select_top(keys: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """bool mask of the `count` entries with the largest keys (ties: lowest flat index first).

    Args:
        keys: (B, T); entries that must never be picked should be -inf, and callers AND the result with
            their candidate mask (when `count` exceeds the candidates, -inf entries fill the remainder).
        count: int scalar tensor, how many to pick.
    """
    order = torch.argsort(keys.flatten(), descending=True, stable=True)
    rank = torch.argsort(order)  # rank[i] = position of flat entry i in the order
    return (rank < count).view_as(keys)


def _num_selected(mask: torch.Tensor, ratio: float) -> torch.Tensor:
    """max(1, floor(ratio * valid tokens)) as an int64 scalar tensor (computed in float64 like Python)."""
    return torch.floor(mask.sum().double() * ratio).long().clamp(min=1)


def _clip_cov_pick(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eligible: torch.Tensor,
    ratio: float,
    bounds: tuple[float, float],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """bool (B, T): up to max(1, floor(ratio * N_tok)) random eligible tokens with lb < cov < ub."""
    cov = logprob_advantage_cov(logprobs, advantages, mask)
    candidates = eligible & (cov > bounds[0]) & (cov < bounds[1])
    noise = torch.rand(mask.shape, generator=generator, device=mask.device)  # random order among candidates
    keys = torch.where(candidates, noise.to(cov.dtype), -torch.inf)
    return select_top(keys, _num_selected(mask, ratio)) & candidates


@POLICY_LOSSES.register("clip_cov")
def clip_cov_policy_loss(
    old_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_length: int | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: PPO-clip, plus a random few high-covariance tokens detached from the gradient.

    Args:
        old_logprobs: (B, T).
        logprobs: (B, T).
        advantages: (B, T).
        response_mask: bool (B, T).
        loss_agg_mode: See `masked.agg_loss`.
        clip_ratio_low: PPO clip below at 1 - clip_ratio_low.
        clip_ratio_high: PPO clip above at 1 + clip_ratio_high.
        clip_ratio_c: Unused (verl's clip_cov has no dual clip); accepted for the common call convention.
        global_num_tokens: See `masked.agg_loss`.
        global_num_seqs: See `masked.agg_loss`.
        max_response_length: See `masked.agg_loss`.
        clip_cov_ratio: Share of valid tokens to detach (at least one).
        clip_cov_lb: Only tokens with cov > clip_cov_lb are candidates.
        clip_cov_ub: Only tokens with cov < clip_cov_ub are candidates.
        generator: Random source for picking among candidates (on the tensors' device).

    Returns:
        (scalar loss, metrics); `pg_clipfrac` is the share of detached tokens (verl).

    Raises:
        ValueError: `clip_cov_ratio <= 0`.
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio={clip_cov_ratio} must be > 0 (verl's default is 0.0002)")
    mask = response_mask.bool()
    log_ratio = masked_log_ratio(logprobs, old_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)

    eligible = mask & ~(clipped > unclipped)  # tokens the PPO clip already handles are never picked
    bounds = (clip_cov_lb, clip_cov_ub)
    detached = _clip_cov_pick(logprobs, advantages, mask, eligible, clip_cov_ratio, bounds, generator)
    pg_losses = torch.where(detached, 0.0, torch.maximum(unclipped, clipped))
    loss = agg_loss(
        pg_losses, mask, loss_agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, max_response_length=max_response_length,
    )  # fmt: skip
    clipfrac = masked_mean(detached.to(ratio.dtype), mask)
    return loss, pg_metrics(clipfrac, masked_mean(-log_ratio, mask))


@POLICY_LOSSES.register("kl_cov")
def kl_cov_policy_loss(
    old_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_length: int | None = None,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: unclipped -A r, plus ppo_kl_coef * |log r| on the top-covariance tokens.

    Args:
        old_logprobs: (B, T).
        logprobs: (B, T).
        advantages: (B, T).
        response_mask: bool (B, T).
        loss_agg_mode: See `masked.agg_loss`.
        clip_ratio_low: Unused (no clipping in KL-Cov); accepted for the common call convention.
        clip_ratio_high: Unused; accepted for the common call convention.
        clip_ratio_c: Unused; accepted for the common call convention.
        global_num_tokens: See `masked.agg_loss`.
        global_num_seqs: See `masked.agg_loss`.
        max_response_length: See `masked.agg_loss`.
        kl_cov_ratio: Share of valid tokens that get the KL penalty (at least one).
        ppo_kl_coef: Weight of |log r| on those tokens.

    Returns:
        (scalar loss, metrics) with `actor/ppo_kl_abs` added (see the module docstring).

    Raises:
        ValueError: `kl_cov_ratio <= 0`.
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio={kl_cov_ratio} must be > 0 (verl's default is 0.0002)")
    mask = response_mask.bool()
    log_ratio = masked_log_ratio(logprobs, old_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio

    cov = logprob_advantage_cov(logprobs, advantages, mask)
    penalised = select_top(cov, _num_selected(mask, kl_cov_ratio)) & mask

    pg_losses = torch.where(penalised, unclipped + ppo_kl_coef * log_ratio.abs(), unclipped)
    loss = agg_loss(
        pg_losses, mask, loss_agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, max_response_length=max_response_length,
    )  # fmt: skip
    metrics = pg_metrics(masked_mean(penalised.to(ratio.dtype), mask), masked_mean(-log_ratio, mask))
    metrics["actor/ppo_kl_abs"] = masked_mean(log_ratio.abs(), mask).detach()
    return loss, metrics
