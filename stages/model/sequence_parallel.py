"""Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) for the packed forward of TokenLogprobs.

The P ranks of a sequence-parallel (SP) group run one micro-batch together: its packed row of T tokens
(stages/model/packing.py `pack_rows`) is padded to a multiple of P and each rank holds T/P consecutive tokens
through every layer but attention. Around attention an all-to-all turns this rank's (T/P tokens, H heads, D)
into (T tokens, H/P heads, D), so each rank attends over the whole row with its share of the heads, and a second
all-to-all turns the output back. Per-token outputs (logprobs, entropies) are computed where their predicting
state is and gathered across the group, so every rank of the group holds the micro-batch's full outputs and
computes the same loss on them.

Deviations from the paper and from verl:
- Attention runs on the packed row (cu_seqlens of the whole row; the padding is one more sequence of its own,
  whose outputs predict nothing), so any number of sequences share the group.
- GQA with fewer (or not divisible) kv heads than P: kv heads are repeated to lcm(H_kv, P) so they split.
- The gather's backward keeps this rank's slice of the gradient and does not multiply it by P (verl does):
  here FSDP2 *sums* gradients over ranks and losses divide by global counts in which each row counts once
  (train_engine.py `global_denominators`). Each rank's backward then covers exactly its part of the group's
  computation (its tokens' layers, its heads' attention), so the sum over the group's ranks is the gradient of
  the group's loss, and the sum over all ranks that of the global loss: the same as data parallelism over
  W / P ranks without SP. verl's FSDP averages over all W ranks, which its x P undoes.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd

FIELD = "rl.actor.ulysses_sequence_parallel_size"


def sequence_parallel_group(size: int) -> dist.ProcessGroup | None:
    """This rank's SP group of `size` consecutive ranks; None when size is 1 (a collective: see consecutive_group)."""
    return consecutive_group(size, FIELD)


def consecutive_group(size: int, field: str) -> dist.ProcessGroup | None:
    """This rank's group of `size` consecutive ranks (ranks 0..P-1, P..2P-1, ...); None when size is 1. A
    collective: every rank of the world creates every group, in the same order. `field`: the setting that asked."""
    if size == 1:
        return None
    world = dist.get_world_size()
    if world % size:
        raise ValueError(f"{field}={size} must divide the number of ranks, {world} "
                         "(ray.num_devices_per_node * ray.num_nodes, or the rollout workers'): change either")
    groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world, size)]
    return groups[dist.get_rank() // size]


def check_heads(config, size: int) -> None:
    """The model's attention heads must split over the group (kv heads are repeated where they do not)."""
    if config.num_attention_heads % size:
        raise ValueError(f"{FIELD}={size} must divide the model's num_attention_heads={config.num_attention_heads}: "
                         "choose a divisor of it")


# ---- the packed row, split ------------------------------------------------------------------------------


def split_packed(packed: dict, rank: int, size: int) -> dict:
    """This rank's part of `pack_rows`' row (host tensors: the counts here are read without a device sync).

    Returns the keys the packed forward reads: input_ids and position_ids (T/P,) of this rank's tokens (the row
    padded to a multiple of P with token 0, positions 0..), cu_seqlens and max_seqlen of the whole padded row
    (the padding is one more sequence), predicting (W,) local indices of this rank's predicting states and
    targets (W,) their tokens, padded to the width W of the busiest rank (states 0 and token 0: computed,
    then dropped), and gather_index (K,): where each of the row's K response tokens lies in the gathered
    (P * W) outputs.
    """
    total = len(packed["input_ids"])
    local = -(-total // size)  # tokens per rank
    pad = local * size - total
    cu = packed["cu_seqlens"]
    if pad:
        cu = torch.cat([cu, cu.new_tensor([total + pad])])
    owner = packed["predicting"] // local  # (K,) non-decreasing: pack_rows lists response tokens in row order
    counts = torch.bincount(owner, minlength=size)
    width = int(counts.max())
    first = counts.cumsum(0) - counts  # (P,) index of each rank's first response token
    mine = owner == rank
    start = rank * local
    positions = torch.cat([packed["position_ids"], torch.arange(pad, device=cu.device)])
    return {
        "input_ids": F.pad(packed["input_ids"], (0, pad))[start : start + local],
        "position_ids": positions[start : start + local],
        "cu_seqlens": cu, "max_seqlen": max(packed["max_seqlen"], pad),
        "predicting": F.pad(packed["predicting"][mine] - start, (0, width - int(counts[rank]))),
        "targets": F.pad(packed["targets"][mine], (0, width - int(counts[rank]))),
        "gather_index": owner * width + torch.arange(len(owner), device=cu.device) - first[owner],
    }


# ---- collectives with autograd --------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x (P, ...): chunk i goes to rank i, chunk j of the result came from rank j; backward sends the gradient's
    chunks back the same way. torch's functional collective, which torch.compile traces with its autograd (an
    autograd.Function around the in-place `dist.all_to_all_single` gave wrong gradients inside compiled layers)."""
    return all_to_all_single_autograd(x.contiguous(), None, None, group)


def tokens_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(T/P, H, D) of this rank's tokens -> (T, H/P, D): every token, this rank's heads."""
    size = dist.get_world_size(group)
    local, heads, dim = x.shape
    chunks = x.view(local, size, heads // size, dim).transpose(0, 1)  # (P, T/P, H/P, D): chunk i to rank i
    return _all_to_all(chunks, group).reshape(size * local, heads // size, dim)


def heads_to_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """(T, H/P, D) of this rank's heads -> (T/P, H, D): this rank's tokens, every head."""
    size = dist.get_world_size(group)
    total, heads, dim = x.shape
    chunks = _all_to_all(x.reshape(size, total // size, heads, dim), group)  # chunk j: rank j's heads
    return chunks.transpose(0, 1).reshape(total // size, size * heads, dim)


def ulysses_attention(attention, query, key, value, cu_seqlens, max_seqlen: int, scale, group) -> torch.Tensor:
    """`attention(query, key, value, cu_seqlens, max_seqlen, scale)` (packing.py `packed_attention`) over the
    whole row, from this rank's tokens: query (T/P, H, D), key/value (T/P, H_kv, D) -> (T/P, H, D)."""
    size = dist.get_world_size(group)
    assert query.shape[1] % size == 0, f"{query.shape[1]} heads do not split over {size} ranks (check_heads)"
    repeat = size // math.gcd(key.shape[1], size)  # kv heads to lcm(H_kv, P): q head h keeps its kv head
    key, value = (x.repeat_interleave(repeat, dim=1) if repeat > 1 else x for x in (key, value))
    q, k, v = (tokens_to_heads(x, group) for x in (query, key, value))
    return heads_to_tokens(attention(q, k, v, cu_seqlens, max_seqlen, scale), group)


class _GatherSlices(torch.autograd.Function):
    """x (..., W) of each rank -> (..., P * W), rank r's at [r * W, (r + 1) * W). Backward keeps this rank's
    slice of the gradient (every rank computes the same loss on the gathered values; see the module docstring
    for why not x P)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None


def gather_outputs(logprobs: torch.Tensor, entropy: torch.Tensor, gather_index: torch.Tensor, group):
    """Per-token outputs (W,) at this rank's predicting states -> the row's (K,) in response order."""
    both = _GatherSlices.apply(torch.stack([logprobs, entropy]), group)  # (2, P * W)
    return both[0, gather_index], both[1, gather_index]
