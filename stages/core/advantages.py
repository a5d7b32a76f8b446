"""Advantage estimators with verl's semantics (`verl/trainer/ppo/core_algos.py`), as plain tensor functions.

Every function returns `(advantages, returns)`, both (B, T) and zero under the mask; no gradient flows
(`torch.no_grad`). Outcome-reward estimators reduce `token_level_rewards` to one score per sequence
(`score_b = sum over valid t of r[b,t]`) and broadcast a per-sequence advantage over the valid tokens.

Masks with holes (multi-turn rollouts: [model][tool][model]...[pad], tool/user tokens False): every estimator
only reads valid positions. The token-level scans (gae, reinforce_plus_plus) skip a masked position, carrying
the next valid token's value and running advantage/return across it, so a tool answer neither discounts
nor restarts them; remax sums rewards over valid tokens; outcome estimators broadcast over the valid tokens
and opo's L counts them. So every estimator gives, on the valid tokens, exactly what it gives on the same
sequences with the masked spans cut out. Rewards must sit on valid tokens (the outcome score on the last
valid one): a reward under the mask is ignored.

    gae                           GAE(gamma, lam) over valid tokens, returns = adv + V, adv whitened.
    grpo / dr_grpo                (score - mean_g) / (std_g + eps); Dr.GRPO drops the std division.
    grpo_passk                    only the best of each group: (max_g - second_max_g) [/ (std_g + eps)].
    rloo                          (score - mean_g) * n / (n - 1) = score - mean of the others.
    opo                           score - sum_g(L * score) / sum_g(L), L the valid-token count.
    gpg                           alpha * (score - mean_g), alpha = B / #(nonzero scores).
    reinforce_plus_plus           discounted return-to-go over valid tokens, whitened over the batch.
    reinforce_plus_plus_baseline  (score - mean_g) broadcast, whitened over the batch.
    remax                         return-to-go minus the greedy response's score.

`mean_g`/`std_g`: mean and unbiased std of the scores of sequence b's group g (same prompt); a group of one
sample has mean 0 and std 1 (verl's behaviour, so it keeps its raw score).

Deviations from verl:
    * `returns` are zeroed under the mask too (verl leaves `adv + values` or carried sums there).
    * Scores sum the rewards of valid tokens only (verl sums the whole row). verl's agent loop puts the
      outcome score on the last non-pad token, a masked tool token when a trajectory ends with a tool
      answer; there verl's grpo family counts it but its gae, reinforce_plus_plus and remax lose it. Here the
      score goes on the last valid token (`stages.batch.token_level_scores`), which every estimator reads.
    * Whitening never raises on a batch with a single valid token (see `masked.masked_var`).
    * `gpg` has no `f_norm` argument: verl's is always 1.
Paper notes kept from verl: `gpg`'s alpha counts sequences with a nonzero score (verl's reading), where
the GPG paper counts sequences in groups whose rewards are not all equal.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from stages.core.groups import Groups, group_max, group_mean, group_mean_std, group_sum, make_groups
from stages.core.masked import masked_sum, masked_whiten

Index = Sequence[Hashable] | torch.Tensor


def _broadcast(per_seq: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, T): the sequence value on valid tokens, 0 elsewhere."""
    return torch.where(response_mask.bool(), per_seq.unsqueeze(-1), 0.0)


def _scores_and_groups(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Index
) -> tuple[torch.Tensor, Groups]:
    scores = masked_sum(token_level_rewards, response_mask, dim=-1)  # (B,)
    return scores, make_groups(index, scores.shape[0], scores.device)


@torch.no_grad()
def gae_advantages(
    token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation, skipping masked positions (verl: observation tokens carry through).

    delta_t = r_t + gamma * V_next - V_t;  A_t = delta_t + gamma * lam * A_next, where "next" is the next
    *valid* token (masked tokens pass V_next and A_next through unchanged).

    Args:
        token_level_rewards: (B, T) rewards r.
        values: (B, T) critic values V of the rollout.
        response_mask: bool (B, T).
        gamma: Discount factor.
        lam: GAE lambda.

    Returns:
        advantages: (B, T), whitened over valid tokens, 0 under the mask.
        returns: (B, T), un-whitened A + V, 0 under the mask.
    """
    mask = response_mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    reversed_advs = []
    for t in reversed(range(values.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        next_adv = torch.where(mask[:, t], adv_t, next_adv)
        reversed_advs.append(next_adv)
    advantages = torch.stack(reversed_advs[::-1], dim=-1)  # (B, T)
    returns = torch.where(mask, advantages + values, 0.0)
    advantages = torch.where(mask, masked_whiten(advantages, mask), 0.0)
    return advantages, returns


@torch.no_grad()
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage; with `norm_adv_by_std_in_grpo=False` it is Dr.GRPO's.

    Args:
        token_level_rewards: (B, T); the score is the sum over tokens.
        response_mask: bool (B, T).
        index: (B,) group id (prompt uid) per sequence.
        epsilon: Added to the std.
        norm_adv_by_std_in_grpo: Divide by the group std (GRPO) or not (Dr.GRPO).

    Returns:
        (advantages, returns), identical, (B, T).
    """
    scores, groups = _scores_and_groups(token_level_rewards, response_mask, index)
    mean, std = group_mean_std(scores, groups)
    adv = scores - mean[groups.ids]
    if norm_adv_by_std_in_grpo:
        adv = adv / (std[groups.ids] + epsilon)
    adv = _broadcast(adv, response_mask)
    return adv, adv


@torch.no_grad()
def grpo_passk_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantage (arXiv 2503.19595): the best response of each group gets max - second max.

    Every other response gets 0. On ties for the best score the first such response (lowest row) is the
    winner, and its advantage is 0 anyway.

    Args:
        token_level_rewards: (B, T).
        response_mask: bool (B, T).
        index: (B,) group id per sequence; every group needs at least 2 samples.
        epsilon: Added to the std.
        norm_adv_by_std_in_grpo: Divide the winner's advantage by its group's unbiased std.

    Returns:
        (advantages, returns), identical, (B, T).

    Raises:
        ValueError: A group has fewer than 2 samples.
    """
    scores, groups = _scores_and_groups(token_level_rewards, response_mask, index)
    if min(groups.sizes) < 2:
        raise ValueError(f"grpo_passk needs at least 2 samples per group; group sizes are {groups.sizes}")
    rows = torch.arange(scores.shape[0], device=scores.device)
    best = group_max(scores, groups)  # (G,)
    candidate_rows = torch.where(scores == best[groups.ids], rows, scores.shape[0])
    first_best = torch.full_like(best, scores.shape[0], dtype=torch.long)
    first_best = first_best.scatter_reduce(0, groups.ids, candidate_rows, reduce="amin")
    is_winner = rows == first_best[groups.ids]  # (B,), one True per group
    second = group_max(torch.where(is_winner, -torch.inf, scores), groups)
    adv = torch.where(is_winner, (best - second)[groups.ids], 0.0)
    if norm_adv_by_std_in_grpo:
        adv = adv / (group_mean_std(scores, groups)[1][groups.ids] + epsilon)
    adv = _broadcast(adv, response_mask)
    return adv, adv


@torch.no_grad()
def rloo_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Index
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (arXiv 2402.14740): score minus the mean of the group's other scores.

    Computed as verl does, `score * n / (n - 1) - mean * n / (n - 1)`; a single-sample group has no
    baseline (advantage = score).

    Args:
        token_level_rewards: (B, T).
        response_mask: bool (B, T).
        index: (B,) group id per sequence.

    Returns:
        (advantages, returns), identical, (B, T).
    """
    scores, groups = _scores_and_groups(token_level_rewards, response_mask, index)
    n = groups.size_per_row(scores)  # (B,)
    scale = n / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, scores * scale - group_mean(scores, groups)[groups.ids] * scale, scores)
    adv = _broadcast(adv, response_mask)
    return adv, adv


@torch.no_grad()
def opo_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Index
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-Policy RL with the Optimal baseline (arXiv 2505.23585): a length-weighted group mean baseline.

    baseline_g = sum_{b in g} L_b * score_b / sum_{b in g} L_b (0 for single-sample groups).

    Args:
        token_level_rewards: (B, T).
        response_mask: bool (B, T); L_b is its row sum (model tokens only, as verl's `response_mask.sum(-1)`).
        index: (B,) group id per sequence.

    Returns:
        (advantages, returns), identical, (B, T).
    """
    scores, groups = _scores_and_groups(token_level_rewards, response_mask, index)
    lengths = response_mask.bool().sum(dim=-1).to(scores.dtype)  # (B,)
    baseline = group_sum(lengths * scores, groups) / group_sum(lengths, groups).clamp(min=1)
    baseline = torch.where(groups.size_per_row(scores) > 1, baseline[groups.ids], 0.0)
    adv = _broadcast(scores - baseline, response_mask)
    return adv, adv


@torch.no_grad()
def gpg_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Index
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Policy Gradient (arXiv 2504.02546) advantage: alpha * (score - mean_g), alpha = B / M.

    M is the number of sequences with a nonzero score, at least 1 (verl's definition).

    Args:
        token_level_rewards: (B, T).
        response_mask: bool (B, T).
        index: (B,) group id per sequence.

    Returns:
        (advantages, returns), identical, (B, T).
    """
    scores, groups = _scores_and_groups(token_level_rewards, response_mask, index)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    adv = _broadcast(alpha * (scores - group_mean(scores, groups)[groups.ids]), response_mask)
    return adv, adv


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv 2501.03262): discounted return-to-go per token, whitened over the batch.

    G_t = r_t + gamma * G_next on valid tokens, where "next" is the next *valid* token: masked positions
    (tool/user tokens inside a multi-turn response, padding after it) pass the running return through
    unchanged and their rewards are dropped, so a reward after a tool answer reaches the turns before it
    (verl PR #7300). On a prefix mask this is the plain reset-after-EOS scan.

    Args:
        token_level_rewards: (B, T).
        response_mask: bool (B, T).
        gamma: Discount factor.

    Returns:
        advantages: (B, T) whitened returns, 0 under the mask.
        returns: (B, T) G, 0 under the mask.
    """
    mask = response_mask.bool()
    running = torch.zeros_like(token_level_rewards[:, 0])
    reversed_returns = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        running = torch.where(mask[:, t], token_level_rewards[:, t] + gamma * running, running)
        reversed_returns.append(running)
    returns = torch.where(mask, torch.stack(reversed_returns[::-1], dim=-1), 0.0)
    advantages = torch.where(mask, masked_whiten(returns, mask), 0.0)
    return advantages, returns


@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Index
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: (score - mean_g) on every valid token, whitened over the batch.

    Args:
        token_level_rewards: (B, T).
        response_mask: bool (B, T).
        index: (B,) group id per sequence.

    Returns:
        (advantages, returns), identical, (B, T).
    """
    scores, groups = _scores_and_groups(token_level_rewards, response_mask, index)
    centered = _broadcast(scores - group_mean(scores, groups)[groups.ids], response_mask)
    adv = torch.where(response_mask.bool(), masked_whiten(centered, response_mask), 0.0)
    return adv, adv


@torch.no_grad()
def remax_advantages(
    token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (arXiv 2310.10505): return-to-go minus the score of the greedy response to the same prompt.

    Args:
        token_level_rewards: (B, T).
        reward_baselines: (B,) score of the greedy (argmax-decoded) response.
        response_mask: bool (B, T).

    Returns:
        advantages: (B, T) returns - baseline on valid tokens.
        returns: (B, T) sum_{s >= t} r_s over valid tokens.
    """
    mask = response_mask.bool()
    rewards = torch.where(mask, token_level_rewards, 0.0)
    returns = torch.where(mask, rewards.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1]), 0.0)
    advantages = returns - _broadcast(reward_baselines, mask)
    return advantages, returns
