"""PPO's clipped value loss (verl's `compute_value_loss`).

With v the new value prediction, v_old the rollout's value, R the return and eps = cliprange_value:

    v_clip = clip(v, v_old - eps, v_old + eps)
    l      = 0.5 * max((v - R)^2, (v_clip - R)^2)          aggregated with `masked.agg_loss`

The max makes the loss pessimistic: a prediction that moved more than eps away from v_old gets no credit for
it. `critic/vf_clipfrac` is the share of valid tokens where the clipped term is the larger.
"""

from __future__ import annotations

import torch

from stages.core.masked import Count, agg_loss, masked_mean


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value-function loss.

    Args:
        values: (B, T) current critic predictions v (with gradient).
        old_values: (B, T) critic values from the rollout, v_old.
        returns: (B, T) targets R (e.g. from the `gae` estimator).
        response_mask: bool (B, T).
        cliprange_value: eps > 0, how far v may move from v_old and still lower the loss.
        loss_agg_mode: See `masked.agg_loss`.
        global_num_tokens: See `masked.agg_loss`.
        global_num_seqs: See `masked.agg_loss`.
        max_response_length: See `masked.agg_loss`.

    Returns:
        (scalar loss, metrics): `critic/vf_clipfrac` and `critic/vpred_mean` (masked mean of v), detached.
    """
    mask = response_mask.bool()
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_loss = (values - returns).square()
    clipped_loss = (clipped_values - returns).square()
    loss = 0.5 * agg_loss(
        torch.maximum(unclipped_loss, clipped_loss), mask, loss_agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, max_response_length=max_response_length,
    )  # fmt: skip
    metrics = {
        "critic/vf_clipfrac": masked_mean((clipped_loss > unclipped_loss).to(values.dtype), mask).detach(),
        "critic/vpred_mean": masked_mean(values, mask).detach(),
    }
    return loss, metrics
