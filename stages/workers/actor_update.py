"""The actor's PPO-style update: mini-batches, micro-batches (fixed size or token budget), ppo_epochs.

Every micro-batch loss is divided by its mini-batch's global denominators (valid tokens, sequences,
summed over the data-parallel ranks), so the gradient of a mini-batch does not depend on how it is split
into micro-batches or ranks. All the math is in stages/core; this file only feeds it.

With N ranks, each holds its share of every mini-batch (stages/batch.py `rank_rows`); the ranks agree on
the number of micro-batches (FSDP runs collectives in every forward, so all ranks must run as many), and
metrics are reduced over ranks, so rank 0 reports the global values.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict

import torch
import torch.distributed as dist

from infra.config import Config
from infra.rl_config import _Optim
from stages.batch import Batch
from stages.core import POLICY_LOSSES, agg_loss, kl_loss, loss_denominators, masked_mean

logger = logging.getLogger(__name__)


def micro_batches(batch: Batch, cfg: _Optim) -> list[list[int]]:
    """Row groups: `micro_batch_size` rows each, or (dynamic) at most `max_token_len_per_device` tokens; as
    many groups on every rank (the largest count any rank needs; see `balanced_groups`)."""
    rows = list(range(len(batch)))
    lengths = batch.tensors["attention_mask"].sum(-1).tolist()
    if not cfg.use_dynamic_bsz:
        groups = [rows[s : s + cfg.micro_batch_size] for s in range(0, len(rows), cfg.micro_batch_size)]
    else:
        groups, current, tokens = [], [], 0
        for row in rows:
            if current and tokens + lengths[row] > cfg.max_token_len_per_device:
                groups.append(current)
                current, tokens = [], 0
            current.append(row)
            tokens += lengths[row]
        groups = groups + [current] if current else groups
    count = int(all_reduce(torch.tensor(float(len(groups))), dist.ReduceOp.MAX))
    return groups if count == len(groups) else balanced_groups(lengths, count)


def balanced_groups(lengths: list[int], count: int) -> list[list[int]]:
    """`count` non-empty row groups with similar token totals (longest row first to the lightest group)."""
    if count > len(lengths):
        raise RuntimeError(f"{len(lengths)} rows cannot fill the {count} micro-batches another rank needs; "
                           "give every rank the same number of rows")
    groups: list[list[int]] = [[] for _ in range(count)]
    totals = [0] * count
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = min(range(count), key=lambda k: (len(groups[k]) > 0, totals[k], k))
        groups[k].append(row)
        totals[k] += lengths[row]
    return [sorted(g) for g in groups]


def all_reduce(value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """`value` reduced over the workers' world (unchanged in a world of one), on its own device."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else value.device
    reduced = value.detach().to(device).clone()
    dist.all_reduce(reduced, op=op)
    return reduced.to(value.device)


def local_mini_rows(cfg: Config) -> int:
    """Rows of one mini-batch on this rank: its share of `ppo_mini_batch_size * n` (the config checks that
    the number of workers divides it)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return cfg.rl.actor.ppo_mini_batch_size * cfg.rl.rollout.n // world


def global_denominators(response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """`loss_denominators` of this rank's part of a mini-batch, summed over the ranks."""
    return {k: all_reduce(v) for k, v in loss_denominators(response_mask).items()}


def grad_norm(module: torch.nn.Module, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


class MetricMeans:
    """Averages of per-micro-batch metrics, weighted by each micro-batch's valid tokens, over all ranks."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)

    def add(self, metrics: dict[str, float], weight: float = 1.0) -> None:
        for key, value in metrics.items():
            self.sums[key] += float(value) * weight
            self.weights[key] += weight

    def result(self) -> dict[str, float]:
        """Global means (a collective: every rank calls it, with the same metric names)."""
        keys = sorted(self.sums)
        values = torch.tensor([[self.sums[k] for k in keys], [self.weights[k] for k in keys]], dtype=torch.float64)
        sums, weights = all_reduce(values).tolist() if keys else ([], [])
        return {k: s / w for k, s, w in zip(keys, sums, weights) if w > 0}


def update_policy(model, optimizer, batch: Batch, cfg: Config, to_device) -> dict[str, float]:
    """Run `ppo_epochs` passes of optimizer steps over mini-batches of `ppo_mini_batch_size` prompts."""
    actor = cfg.rl.actor
    mini_size = local_mini_rows(cfg)
    means = MetricMeans()
    skipped = 0
    for _ in range(actor.ppo_epochs):
        for start in range(0, len(batch), mini_size):
            mini = batch.select(list(range(start, min(start + mini_size, len(batch)))))
            denominators = global_denominators(mini.response_mask)
            mini_loss = 0.0
            for rows in micro_batches(mini, actor):
                micro = mini.select(rows)
                loss, metrics = micro_loss(model, micro, denominators, cfg, to_device)
                loss.backward()
                mini_loss += float(loss.detach())
                means.add(metrics, weight=float(micro.response_mask.sum()))
            norm = grad_norm(model, actor.grad_clip)
            if math.isfinite(norm):
                optimizer.step()
            else:
                skipped += 1
                logger.warning("actor: non-finite gradient norm (%s); optimizer step skipped", norm)
            optimizer.zero_grad(set_to_none=True)
            global_loss = all_reduce(torch.tensor(mini_loss, dtype=torch.float64))  # the mini-batch's loss
            means.add({"actor/grad_norm": norm, "actor/loss": float(global_loss)})
    return {**means.result(), "actor/skipped_steps": skipped}


def micro_loss(model, micro: Batch, denominators: dict, cfg: Config, to_device):
    """Policy loss (+ KL loss, - entropy bonus) of one micro-batch, scaled by the global denominators."""
    actor = cfg.rl.actor
    t = to_device(micro.tensors)
    logprobs, entropy = model(**to_device(micro), temperature=cfg.rl.rollout.temperature,
                              with_entropy=True)
    mask = t["response_mask"]
    scale = {**denominators, "max_response_length": cfg.data.max_response_length}
    pg_loss, pg_metrics = POLICY_LOSSES.get(actor.policy_loss)(
        t["old_logprobs"], logprobs, t["advantages"], mask, actor.loss_agg_mode,
        clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c, **scale,
    )
    loss = pg_loss
    metrics = {k: float(v) for k, v in pg_metrics.items()}
    metrics["actor/entropy"] = float(masked_mean(entropy.detach(), mask))
    if actor.entropy_coeff > 0:
        loss = loss - actor.entropy_coeff * agg_loss(entropy, mask, actor.loss_agg_mode, **scale)
    if actor.use_kl_loss:
        kl, kl_metrics = kl_loss(logprobs, t["ref_logprobs"], mask, actor.kl_loss_type, actor.loss_agg_mode, **scale)
        loss = loss + actor.kl_loss_coef * kl
        metrics["actor/kl_loss"] = float(kl.detach()) * local_scale(denominators, mask)
        metrics["actor/kl_coef"] = actor.kl_loss_coef
    metrics["actor/pg_loss"] = float(pg_loss.detach()) * local_scale(denominators, mask)
    return loss, metrics


def local_scale(denominators: dict, mask: torch.Tensor) -> float:
    """Undo the global token denominator, so a micro-batch's loss metric is its own token mean."""
    return float(denominators["global_num_tokens"]) / max(float(mask.sum()), 1.0)
