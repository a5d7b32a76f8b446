"""Online DPO: preference pairs from each group's rewards, and DPO's loss against the reference.

Notation: B rows, T response tokens, G groups (the n samples of one prompt), P pairs. A response y's sequence
log-probability is log pi(y) = sum of its token logprobs over the model's own tokens (response_mask True; a
multi-turn response's tool and user tokens are not the policy's). pi_ref is the frozen reference, beta DPO's
inverse temperature. For a pair (y_w chosen, y_l rejected):

    r(y)     = beta * (log pi(y) - log pi_ref(y))              the implicit reward
    loss_p   = -log sigmoid(r(y_w) - r(y_l))
    loss     = sum_p loss_p / P_global                          P_global: pairs of the whole mini-batch

(DPO: Rafailov et al. 2023, arXiv 2305.18290, eq. 7. Online: the pairs are sampled from the current policy
each step and labelled by the reward, as in Guo et al. 2024, arXiv 2402.04792.)

Pairs: of each group, the best and the worst sample by sequence reward (the first row on ties), and no pair
when they differ by at most `min_margin` (no preference). Layout: rows 2p and 2p + 1 of a pair batch are pair
p's chosen and rejected responses (`pair_order`), so micro-batches and ranks that take even, consecutive row
ranges never split a pair.

Deviations from TRL's OnlineDPOTrainer:
    * pairs are the best and the worst of n samples by the task's reward (TRL: 2 samples ranked by a judge or
      a reward model);
    * the loss is divided by the mini-batch's global number of pairs (`global_num_pairs`), so micro-batching and
      data parallelism do not change it (TRL: the mean over its local batch);
    * the sigmoid loss only: no label smoothing, no IPO or hinge variants.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from stages.core.groups import group_max, make_groups
from stages.core.masked import Count, masked_sum


class Pairs(NamedTuple):
    """Each group's best and worst row.

    Attributes:
        chosen: int64 (G,), the row of each group's highest score (the first such row on ties).
        rejected: int64 (G,), the row of its lowest score (the first such row).
        preferred: bool (G,), whether the best beats the worst by more than `min_margin` (else no pair).
    """

    chosen: torch.Tensor
    rejected: torch.Tensor
    preferred: torch.Tensor


def preference_pairs(scores: torch.Tensor, index: Sequence[Hashable] | torch.Tensor,
                     min_margin: float = 1e-6) -> Pairs:
    """The best and the worst sample of every group.

    Args:
        scores: (B,) one reward per sequence.
        index: (B,) group id per row (tensor, numpy array or list of hashables).
        min_margin: A group whose best and worst differ by at most this much has no preference (as the learning
            signal's zero-spread groups, infra/learning_signal.py).

    Returns:
        `Pairs`, groups in order of first appearance in `index`.
    """
    num_rows = scores.shape[0]
    groups = make_groups(index, num_rows, scores.device)
    best = group_max(scores, groups)  # (G,)
    worst = -group_max(-scores, groups)
    rows = torch.arange(num_rows, device=scores.device)

    def first(hit: torch.Tensor) -> torch.Tensor:  # (G,) the smallest row of each group where `hit`
        start = torch.full((groups.num_groups,), num_rows, dtype=torch.long, device=scores.device)
        return start.scatter_reduce(0, groups.ids, torch.where(hit, rows, num_rows), reduce="amin")

    chosen, rejected = first(scores == best[groups.ids]), first(scores == worst[groups.ids])
    return Pairs(chosen, rejected, best - worst > min_margin)


def pair_order(pairs: Pairs) -> torch.Tensor:
    """(2P,) rows [chosen_0, rejected_0, chosen_1, rejected_1, ...] of the groups with a preference, in group
    order: the pair layout `dpo_loss` reads."""
    keep = pairs.preferred
    return torch.stack([pairs.chosen[keep], pairs.rejected[keep]], dim=1).reshape(-1)


def preference_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                          index: Sequence[Hashable] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online DPO's labels as advantages: +1 on each group's chosen row, -1 on its rejected row, 0 on the other
    rows and on groups without a preference; over the valid tokens.

    Args:
        token_level_rewards: (B, T); a sequence's reward is the sum over its valid tokens.
        response_mask: bool (B, T).
        index: (B,) group id per row.

    Returns:
        (labels, labels), each (B, T), zero under the mask.
    """
    mask = response_mask.bool()
    pairs = preference_pairs(masked_sum(token_level_rewards, mask, dim=-1), index)
    labels = torch.zeros(mask.shape[0], dtype=token_level_rewards.dtype, device=mask.device)
    labels = labels.index_put((pairs.chosen,), pairs.preferred.to(labels.dtype))
    labels = labels.index_put((pairs.rejected,), torch.where(pairs.preferred, -1.0, 0.0).to(labels.dtype))
    advantages = torch.where(mask, labels.unsqueeze(-1), 0.0)
    return advantages, advantages


def dpo_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    beta: float,
    global_num_pairs: Count | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO's sigmoid loss of the pairs in `logprobs` (pair layout: rows 2p chosen, 2p + 1 rejected).

    Args:
        logprobs: (B, T) log pi of the sampled tokens, B = 2P.
        ref_logprobs: (B, T) log pi_ref (no gradient).
        response_mask: bool (B, T); only True tokens count (multi-turn holes and padding do not).
        beta: DPO's beta.
        global_num_pairs: Pairs of the whole mini-batch (all micro-batches, all ranks), the loss's denominator;
            micro-batch losses then sum to the mini-batch loss. None: P, the pairs given here.

    Returns:
        (scalar loss, metrics): detached means over the P pairs given here, TRL's names under `dpo/`:
        `dpo/rewards/chosen` and `/rejected` (mean r(y_w), r(y_l)), `dpo/rewards/margins` (mean r(y_w) - r(y_l)),
        `dpo/rewards/accuracies` (share of pairs with r(y_w) > r(y_l)), `dpo/logps/chosen` and `/rejected` (mean
        sequence log pi).

    Raises:
        ValueError: an odd number of rows (a split pair).
    """
    if logprobs.shape[0] % 2:
        raise ValueError(f"dpo_loss: {logprobs.shape[0]} rows cannot be (chosen, rejected) pairs; a pair was split")
    mask = response_mask.bool()
    logps = masked_sum(logprobs, mask, dim=-1)  # (B,)
    rewards = beta * (logps - masked_sum(ref_logprobs, mask, dim=-1))  # (B,)
    margins = rewards[0::2] - rewards[1::2]  # (P,)
    num_pairs = margins.shape[0] if global_num_pairs is None else global_num_pairs
    loss = -F.logsigmoid(margins).sum() / num_pairs
    metrics = {
        "dpo/rewards/chosen": rewards[0::2].mean(),
        "dpo/rewards/rejected": rewards[1::2].mean(),
        "dpo/rewards/margins": margins.mean(),
        "dpo/rewards/accuracies": (margins > 0).to(margins.dtype).mean(),
        "dpo/logps/chosen": logps[0::2].mean(),
        "dpo/logps/rejected": logps[1::2].mean(),
    }
    return loss, {k: v.detach() for k, v in metrics.items()}
