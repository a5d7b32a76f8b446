"""Group statistics for outcome-reward estimators (GRPO and friends), vectorised with `index_add`.

A group is the set of responses sampled for one prompt. Group ids come as any sequence of hashables of
length B (an int tensor, a numpy array of uid strings, a list); they are mapped to dense ids 0..G-1 in order
of first appearance on the host, so no tensor is read back from the device except an `index` tensor itself.

Single-sample groups follow verl: mean 0 and std 1, so such a response keeps its raw score.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch


class Groups(NamedTuple):
    """Dense group membership of a batch.

    Attributes:
        ids: int64 (B,), dense group id of each sequence, on the scores' device.
        sizes: Python list of length G, number of sequences in each group (host-side: checks need no sync).
    """

    ids: torch.Tensor
    sizes: list[int]

    @property
    def num_groups(self) -> int:
        return len(self.sizes)

    def size_per_row(self, like: torch.Tensor) -> torch.Tensor:
        """(B,) size of each sequence's group, with `like`'s dtype and device."""
        return torch.tensor(self.sizes, dtype=like.dtype, device=like.device)[self.ids]


def make_groups(index: Sequence[Hashable] | torch.Tensor, batch_size: int, device: torch.device) -> Groups:
    """Map group ids to dense ids 0..G-1 (order of first appearance).

    Args:
        index: (B,) group id per sequence: a tensor, numpy array or list of hashables.
        batch_size: B, to check `index` against.
        device: Where to put the dense ids.

    Returns:
        The batch's `Groups`.

    Raises:
        ValueError: `index` is missing or has the wrong length.
    """
    if index is None:
        raise ValueError("index is None: group-based estimators need one group id (e.g. the prompt uid) per row")
    keys = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(keys) != batch_size:
        raise ValueError(f"index has {len(keys)} entries but the batch has {batch_size} rows; give one id per row")
    dense: dict[Hashable, int] = {}
    ids = [dense.setdefault(key, len(dense)) for key in keys]
    sizes = [0] * len(dense)
    for i in ids:
        sizes[i] += 1
    return Groups(torch.tensor(ids, dtype=torch.long, device=device), sizes)


def group_sum(values: torch.Tensor, groups: Groups) -> torch.Tensor:
    """(G,) sum of `values` (B,) within each group."""
    zeros = torch.zeros(groups.num_groups, dtype=values.dtype, device=values.device)
    return zeros.index_add(0, groups.ids, values)


def group_max(values: torch.Tensor, groups: Groups) -> torch.Tensor:
    """(G,) maximum of `values` (B,) within each group."""
    init = torch.full((groups.num_groups,), -torch.inf, dtype=values.dtype, device=values.device)
    return init.scatter_reduce(0, groups.ids, values, reduce="amax", include_self=True)


def group_mean_std(scores: torch.Tensor, groups: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group mean and unbiased std (torch.std's default), verl's (0, 1) for single-sample groups.

    Args:
        scores: (B,) one scalar per sequence.
        groups: Membership from `make_groups`.

    Returns:
        (mean, std), each (G,).
    """
    counts = torch.tensor(groups.sizes, dtype=scores.dtype, device=scores.device)  # (G,)
    mean = group_sum(scores, groups) / counts
    squares = group_sum((scores - mean[groups.ids]).square(), groups)
    std = torch.sqrt(squares / (counts - 1).clamp(min=1))
    single = counts == 1
    return torch.where(single, 0.0, mean), torch.where(single, 1.0, std)


def group_mean(scores: torch.Tensor, groups: Groups) -> torch.Tensor:
    """(G,) per-group mean, 0 for single-sample groups (verl)."""
    return group_mean_std(scores, groups)[0]
