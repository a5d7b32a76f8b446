"""Policy-gradient losses with verl's semantics, in one registry with one call convention.

Notation: r = exp(logprobs - old_logprobs) per token (the importance ratio, log-ratio clamped to [-20, 20]
before the exp), A the advantage, eps_lo / eps_hi = clip_ratio_low / clip_ratio_high, c = clip_ratio_c.

    vanilla   PPO-clip with DAPO's asymmetric clip-higher and dual-clip (arXiv 1912.09729) for A < 0:
                  l = max(-A r, -A clip(r, 1 - eps_lo, 1 + eps_hi));  if A < 0: l = min(l, -A c)
    gspo      GSPO (arXiv 2507.18071): the sequence ratio s = exp(mean_t log r) replaces r, with the
              token-level stop-gradient form  s_t = sg(s) * pi / sg(pi)  (value s, gradient of log pi):
                  l = max(-A s_t, -A clip(s_t, 1 - eps_lo, 1 + eps_hi))
    gpg       GPG (arXiv 2504.02546): l = -A log pi, no ratio, no clipping.
    cispo     CISPO (MiniMax-M1, arXiv 2506.13585): l = -sg(clip(r, 1 - eps_lo, 1 + eps_hi)) A log pi; the
              clipped weight is a constant, so every token keeps a gradient.

Call convention (every entry of `POLICY_LOSSES`, including clip_cov / kl_cov in `cov_losses`):

    loss, metrics = fn(old_logprobs, logprobs, advantages, response_mask, loss_agg_mode,
                       clip_ratio_low=..., clip_ratio_high=..., clip_ratio_c=3.0,
                       global_num_tokens=None, global_num_seqs=None, max_response_length=None,
                       **loss_specific_keywords)

Tensors are (B, T); `loss` is a scalar aggregated by `masked.agg_loss` (whose global denominators make
micro-batch losses sum to the mini-batch loss); `metrics` holds detached scalars `actor/pg_clipfrac`,
`actor/ppo_kl` (masked mean of old - new logprob) and `actor/pg_clipfrac_lower` (0 where a loss has no lower
clip). Metrics are means over the given micro-batch. Losses that do not clip accept and ignore the clip
ratios, so the loop can call any entry the same way.

Deviations from verl:
    * gspo aggregates with the `loss_agg_mode` it is given; verl overrides any mode with seq-mean-token-mean.
      The config gives gspo seq-mean-token-mean unless rl.actor.loss_agg_mode is set (infra/trainer_config.py).
    * gpg reports the real `actor/ppo_kl` (verl reports 0).
    * The log-ratio is zeroed under the mask before use, so garbage (even inf) there cannot reach the loss
      or its gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stages.core.masked import Count, agg_loss, masked_mean, masked_sum
from stages.core.registry import Registry

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")

LOG_RATIO_CLAMP = 20.0


def masked_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) log pi - log pi_old on valid tokens, 0 under the mask (differentiable w.r.t. `logprobs`)."""
    return torch.where(mask.bool(), logprobs - old_logprobs, 0.0)


def pg_metrics(
    clipfrac: torch.Tensor, ppo_kl: torch.Tensor, clipfrac_lower: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The common metric dict, detached; a missing lower clip fraction is reported as 0."""
    lower = torch.zeros_like(ppo_kl) if clipfrac_lower is None else clipfrac_lower
    return {
        "actor/pg_clipfrac": clipfrac.detach(),
        "actor/ppo_kl": ppo_kl.detach(),
        "actor/pg_clipfrac_lower": lower.detach(),
    }


@POLICY_LOSSES.register("vanilla")
def vanilla_policy_loss(
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clipping and dual-clip (verl's `vanilla`).

    Args:
        old_logprobs: (B, T) log pi_old of the sampled tokens (no gradient).
        logprobs: (B, T) log pi of the sampled tokens under the current policy.
        advantages: (B, T).
        response_mask: bool (B, T).
        loss_agg_mode: See `masked.agg_loss`.
        clip_ratio_low: eps_lo; the ratio is clipped below at 1 - eps_lo.
        clip_ratio_high: eps_hi; clipped above at 1 + eps_hi (DAPO's clip-higher uses eps_hi > eps_lo).
        clip_ratio_c: Dual-clip bound c > 1: for A < 0 the loss is capped at -A * c.
        global_num_tokens: See `masked.agg_loss`.
        global_num_seqs: See `masked.agg_loss`.
        max_response_length: See `masked.agg_loss`.

    Returns:
        (scalar loss, metrics): metrics as in the module docstring; `pg_clipfrac_lower` is the share of
        tokens where the dual clip bound is active.

    Raises:
        ValueError: `clip_ratio_c <= 1`.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c}: the dual-clip bound must be > 1 (verl's default is 3.0)")
    mask = response_mask.bool()
    log_ratio = masked_log_ratio(logprobs, old_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)

    loss = agg_loss(
        pg_losses, mask, loss_agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, max_response_length=max_response_length,
    )  # fmt: skip
    clipfrac = masked_mean((clipped > unclipped).to(ratio.dtype), mask)
    clipfrac_lower = masked_mean(((clip_loss > dual_bound) & negative).to(ratio.dtype), mask)
    return loss, pg_metrics(clipfrac, masked_mean(-log_ratio, mask), clipfrac_lower)


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    old_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimization: a length-normalised sequence ratio, clipped (verl's `gspo`).

    log s_b = mean over valid t of (log pi - log pi_old); per token log s_t = sg(log s_b) + log pi - sg(log pi),
    clamped above at 10 as verl does. Clip ratios are typically tiny (e.g. 3e-4 / 4e-4).

    Args:
        old_logprobs: (B, T).
        logprobs: (B, T).
        advantages: (B, T), usually constant over each sequence.
        response_mask: bool (B, T).
        loss_agg_mode: Default seq-mean-token-mean, the paper's (and what verl forces).
        clip_ratio_low: Sequence-ratio clip below at 1 - clip_ratio_low.
        clip_ratio_high: Sequence-ratio clip above at 1 + clip_ratio_high.
        clip_ratio_c: Unused (no dual clip in GSPO); accepted for the common call convention.
        global_num_tokens: See `masked.agg_loss`.
        global_num_seqs: See `masked.agg_loss`.
        max_response_length: See `masked.agg_loss`.

    Returns:
        (scalar loss, metrics); `pg_clipfrac_lower` is 0.
    """
    mask = response_mask.bool()
    log_ratio = masked_log_ratio(logprobs, old_logprobs, mask)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1).to(log_ratio.dtype)
    valid_logprobs = torch.where(mask, logprobs, 0.0)
    token_log_ratio = valid_logprobs - valid_logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=10.0))  # (B, T), value s_b, gradient d log pi
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)

    loss = agg_loss(
        pg_losses, mask, loss_agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, max_response_length=max_response_length,
    )  # fmt: skip
    clipfrac = masked_mean((clipped > unclipped).to(ratio.dtype), mask)
    return loss, pg_metrics(clipfrac, masked_mean(-log_ratio, mask))


@POLICY_LOSSES.register("gpg")
def gpg_policy_loss(
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Policy Gradient: plain REINFORCE on the sampled tokens, l = -A * log pi (verl's `gpg`).

    Args:
        old_logprobs: (B, T); only for the `actor/ppo_kl` metric.
        logprobs: (B, T).
        advantages: (B, T), e.g. from the `gpg` estimator.
        response_mask: bool (B, T).
        loss_agg_mode: See `masked.agg_loss`.
        clip_ratio_low: Unused; accepted for the common call convention.
        clip_ratio_high: Unused; accepted for the common call convention.
        clip_ratio_c: Unused; accepted for the common call convention.
        global_num_tokens: See `masked.agg_loss`.
        global_num_seqs: See `masked.agg_loss`.
        max_response_length: See `masked.agg_loss`.

    Returns:
        (scalar loss, metrics); both clip fractions are 0.
    """
    mask = response_mask.bool()
    pg_losses = -advantages * logprobs
    loss = agg_loss(
        pg_losses, mask, loss_agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, max_response_length=max_response_length,
    )  # fmt: skip
    ppo_kl = masked_mean(-masked_log_ratio(logprobs, old_logprobs, mask), mask)
    return loss, pg_metrics(torch.zeros_like(ppo_kl), ppo_kl)


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped IS-weight Policy Optimization: l = -sg(clip(r, 1 - eps_lo, 1 + eps_hi)) * A * log pi.

    The paper sets eps_lo large (no lower bound) and tunes only eps_hi.

    Args:
        old_logprobs: (B, T).
        logprobs: (B, T).
        advantages: (B, T).
        response_mask: bool (B, T).
        loss_agg_mode: See `masked.agg_loss`.
        clip_ratio_low: The IS weight is clipped below at 1 - clip_ratio_low.
        clip_ratio_high: The IS weight is clipped above at 1 + clip_ratio_high.
        clip_ratio_c: Unused; accepted for the common call convention.
        global_num_tokens: See `masked.agg_loss`.
        global_num_seqs: See `masked.agg_loss`.
        max_response_length: See `masked.agg_loss`.

    Returns:
        (scalar loss, metrics); `pg_clipfrac` is the share of tokens whose weight was clipped,
        `pg_clipfrac_lower` is 0 (verl).
    """
    mask = response_mask.bool()
    log_ratio = masked_log_ratio(logprobs, old_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    pg_losses = -weight * advantages * logprobs
    loss = agg_loss(
        pg_losses, mask, loss_agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, max_response_length=max_response_length,
    )  # fmt: skip
    clipfrac = masked_mean((ratio.detach() != weight).to(ratio.dtype), mask)
    return loss, pg_metrics(clipfrac, masked_mean(-log_ratio, mask))
