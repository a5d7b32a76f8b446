"""One update loop for every trained model (actor, critic): epochs x mini-batches x micro-batches.

`TrainEngine` owns a model's optimizer, LR schedule and update loop; a role gives it only its micro-batch loss
(`loss_fn(micro, denominators) -> (loss, metrics)`): the actor's policy loss (actor_loss.py), the critic's value
loss (critic.py). Every micro-batch loss is divided by its mini-batch's global denominators (valid tokens,
sequences, summed over the data-parallel ranks), so the gradient of a mini-batch does not depend on how it is
split into micro-batches or ranks. Each role reports the same loop metrics: `<role>/grad_norm`, `<role>/loss`
(the mini-batch's), `<role>/lr` (the lr this step used) and `<role>/skipped_steps` (non-finite gradient norms).

With N ranks, each holds its share of every mini-batch (stages/batch.py `rank_rows`); the ranks agree on
the number of micro-batches (FSDP runs collectives in every forward, so all ranks must run as many), and
metrics are reduced over ranks, so rank 0 reports the global values. Under Ulysses sequence parallelism
(`sequence_parallel_size` P > 1, stages/model/sequence_parallel.py) the P ranks of a group hold the same rows and
compute the same loss: the data-parallel ranks are N / P, and the global counts and the loss metric count each
row once (the token-weighted metric means are unchanged by the P equal copies).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import BaseModel

from infra.config import Config
from infra.trainer_config import TrainerConfig
from stages.batch import Batch
from stages.core import loss_denominators
from stages.model.fsdp import all_reduce, load_train_state, save_train_state
from stages.model.optim import OffloadedAdamW, build_optimizer, build_scheduler, clipped_step
from stages.model.rng import rng_state, set_rng_state
from stages.model.safe_load import load_state

logger = logging.getLogger(__name__)
LossFn = Callable[[Batch, dict], tuple[torch.Tensor, dict]]


class TrainEngine:
    """A trained model's optimizer, LR schedule and update loop (`update`), and its checkpoint state."""

    def __init__(self, role: str, model: torch.nn.Module, cfg: TrainerConfig, total_steps: int, mini_rows: int,
                 unit_rows: int = 1, sequence_parallel_size: int = 1):
        """`unit_rows`: consecutive rows that must share a micro-batch (2: online DPO's (chosen, rejected) pairs);
        `sequence_parallel_size`: ranks that hold the same rows (a Ulysses group)."""
        self.role, self.model, self.cfg, self.mini_rows, self.unit_rows = role, model, cfg, mini_rows, unit_rows
        self.sequence_parallel_size = sequence_parallel_size
        self.optimizer = build_optimizer(model.parameters(), cfg.optim, cfg.optimizer_offload)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, total_steps)

    def update(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """`ppo_epochs` passes of optimizer steps over mini-batches of `mini_rows` rows; one LR schedule step."""
        self.model.train()
        means, skipped = MetricMeans(), 0.0
        for _ in range(self.cfg.ppo_epochs):
            for start in range(0, len(batch), self.mini_rows):
                mini = batch.select(list(range(start, min(start + self.mini_rows, len(batch)))))
                skipped = skipped + self._step(mini, loss_fn, means)
        skipped = int(skipped)
        if skipped:
            logger.warning("%s: %d optimizer step(s) skipped: non-finite gradient norm", self.role, skipped)
        lr = self.scheduler.get_last_lr()[0]  # the lr this step used
        self.scheduler.step()
        return {**means.result(), f"{self.role}/skipped_steps": skipped, f"{self.role}/lr": lr}

    def _step(self, mini: Batch, loss_fn: LossFn, means: MetricMeans) -> torch.Tensor:
        """Accumulate the mini-batch's micro-batch gradients, clip, step; -> 1.0 if the step was skipped."""
        sp = self.sequence_parallel_size
        denominators = global_denominators(mini.response_mask, sp)
        mini_loss = 0.0
        for rows in accumulate(self.model, micro_batches(mini, self.cfg, self.unit_rows, sp), self.cfg):
            micro = mini.select(rows)
            loss, metrics = loss_fn(micro, denominators)
            loss.backward()
            mini_loss = mini_loss + loss.detach()
            means.add(metrics, weight=float(micro.response_mask.sum()))
        norm, found_inf = clipped_step(self.model, self.optimizer, self.cfg.optim.grad_clip)
        means.add({f"{self.role}/grad_norm": norm, f"{self.role}/loss": all_reduce(mini_loss) / sp})
        return found_inf

    def save(self, path: Path) -> None:
        """The sharded train state (DCP) and this rank's random generators (dropout) into `path`."""
        save_train_state(path, self.model, self.optimizer, self.scheduler)
        torch.save(rng_state(), path / self._rng_file())
        self._offload_optimizer()

    def load(self, path: Path) -> None:
        load_train_state(path, self.model, self.optimizer, self.scheduler)
        rng = path / self._rng_file()
        if rng.is_file():  # absent when another number of ranks, or a version before 2026-11-28, wrote it
            set_rng_state(load_state(rng))
        self._offload_optimizer()

    def _rng_file(self) -> str:
        return f"rng_rank{dist.get_rank() if dist.is_initialized() else 0}.pt"

    def _offload_optimizer(self) -> None:
        """`optimizer_offload`: reading or writing the state brought the moments to the device; send them back
        before generation needs the memory."""
        if isinstance(self.optimizer, OffloadedAdamW):
            self.optimizer.offload()


def micro_batches(batch: Batch, cfg: TrainerConfig, unit_rows: int = 1, sequence_parallel_size: int = 1
                  ) -> list[list[int]]:
    """Row groups: `micro_batch_size` rows each, or (dynamic, verl's use_dynamic_bsz) as many groups as a
    budget of `max_token_len_per_device` tokens each needs, balanced in tokens (so no group is a small
    remainder; each stays within about one sequence of the budget); as many groups on every rank (the
    largest count any rank needs; see `balanced_groups`). Units of `unit_rows` consecutive rows (a DPO pair:
    2) are never split: the groups are made of units (the config makes micro_batch_size a multiple). A Ulysses
    group of `sequence_parallel_size` devices shares a micro-batch: its budget is theirs together (as verl's)."""
    row_lengths = batch.tensors["attention_mask"].sum(-1).tolist()
    lengths = [sum(row_lengths[i : i + unit_rows]) for i in range(0, len(row_lengths), unit_rows)]  # per unit
    if cfg.use_dynamic_bsz:
        groups = []
        count = budget_count(lengths, cfg.max_token_len_per_device * sequence_parallel_size)
    else:
        units, size = list(range(len(lengths))), max(1, cfg.micro_batch_size // unit_rows)
        groups = [units[s : s + size] for s in range(0, len(units), size)]
        count = len(groups)
    count = int(all_reduce(torch.tensor(float(count)), dist.ReduceOp.MAX))
    groups = groups if count == len(groups) else balanced_groups(lengths, count)
    return [[u * unit_rows + k for u in group for k in range(unit_rows)] for group in groups]


def budget_count(lengths: list[int], budget: int) -> int:
    """Micro-batches of at most `budget` tokens that the rows need, filled in order (a row over the budget
    gets one of its own)."""
    count, tokens = 0, budget
    for length in lengths:
        if tokens + length > budget:
            count, tokens = count + 1, 0
        tokens += length
    return count


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


CHECKPOINT_SHARE = 0.4  # see state_is_large
GATHERED_SHARE = 0.25  # of device memory that a model's gathered bf16 weights + fp32 gradients may take


def gathered_fits(model: torch.nn.Module) -> bool:
    """Whether a rank can hold the whole model gathered: on one device (where the gather is a copy), or when
    its bf16 weights and fp32 gradients (6 bytes per parameter) take at most GATHERED_SHARE of the GPU's
    memory. The automatic choice of `reshard_after_forward` and `grad_sync_every_micro_batch`: keeping
    weights and gradients gathered saves collectives (1.85x instead of 1.67x the 1-GPU throughput on 2
    H200s for a 0.5B model, bench/results/2026-11-22-gpu-worker.md) but costs memory that large models need."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    if not torch.cuda.is_available():
        return False
    params = sum(p.numel() for p in model.parameters())
    return 6 * params <= GATHERED_SHARE * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def state_is_large(num_params: int, world_size: int, device_bytes: int) -> bool:
    """The automatic `rl.actor.gradient_checkpointing`: whether a rank's share of fp32 weights, gradients and
    AdamW moments (16 bytes per parameter) takes more than CHECKPOINT_SHARE of its GPU, so that activations must
    be recomputed to leave room (a 7B model on one H200: 81%, it needs it; 3B: 33%, which trained without
    it on 12k-token micro-batches, faster: bench/results/2026-11-24-gpu-shapes.md)."""
    return 16 * num_params / world_size > CHECKPOINT_SHARE * device_bytes


def resolve_trainer(cfg: TrainerConfig, model: torch.nn.Module) -> TrainerConfig:
    """The section with its automatic (None) FSDP2 fields decided: `reshard_after_forward` and
    `grad_sync_every_micro_batch` are False when the gathered model fits (`gathered_fits`) and nothing is offloaded,
    else True (offload is for models whose state does not fit: keep only one layer gathered)."""
    fits = gathered_fits(model) and not cfg.offload
    decide = lambda value: not fits if value is None else value  # noqa: E731
    return cfg.model_copy(update={"reshard_after_forward": decide(cfg.reshard_after_forward),
                                  "grad_sync_every_micro_batch": decide(cfg.grad_sync_every_micro_batch)})


def automatic_fields(given: BaseModel, resolved: BaseModel, prefix: str) -> dict[str, object]:
    """`prefix.field`: value for each field that was None (automatic) in `given` and is decided in `resolved`."""
    return {f"{prefix}.{name}": getattr(resolved, name) for name in type(given).model_fields
            if getattr(given, name) is None and getattr(resolved, name) is not None}


def accumulate(model, groups: list[list[int]], cfg: TrainerConfig):
    """Yield the micro-batches' rows; unless `grad_sync_every_micro_batch`, FSDP2 reduces the summed gradients
    once, after the mini-batch's last one. When the weights also stay gathered through forward
    (`reshard_after_forward` False), they stay gathered from one micro-batch to the next too (they do not change
    within a mini-batch): one gather per mini-batch instead of one per micro-batch (at N = 1 a cast and copies of
    every parameter, and their launches). `cfg` is resolved (`resolve_trainer`)."""
    every = cfg.grad_sync_every_micro_batch
    keep = not every and not cfg.reshard_after_forward
    for i, rows in enumerate(groups):
        last = i == len(groups) - 1
        if not every:
            model.set_requires_gradient_sync(last)
        if keep:
            model.set_reshard_after_backward(last)
        yield rows


def local_mini_rows(cfg: Config, sequence_parallel_size: int = 1) -> int:
    """Rows of one mini-batch on this rank: its data-parallel share of `ppo_mini_batch_size * n` (online DPO: `* 2`,
    one pair per prompt; the config checks that the number of workers divides it), the ranks of a Ulysses group of
    `sequence_parallel_size` sharing one."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return cfg.rl.actor.ppo_mini_batch_size * cfg.rl.train_rows_per_prompt // (world // sequence_parallel_size)


def global_denominators(response_mask: torch.Tensor, sequence_parallel_size: int = 1) -> dict[str, torch.Tensor]:
    """`loss_denominators` of this rank's part of a mini-batch, summed over the data-parallel ranks (the sum over
    all ranks counts the rows of a Ulysses group once per rank: divided by `sequence_parallel_size`)."""
    return {k: all_reduce(v) // sequence_parallel_size for k, v in loss_denominators(response_mask).items()}


class MetricMeans:
    """Averages of per-micro-batch metrics, weighted by each micro-batch's valid tokens, over all ranks.

    Values may be device tensors: they are summed where they are and read once, in `result`, so the
    micro-batch loop never waits for the device (a host sync per metric would idle it between kernels)."""

    def __init__(self):
        self.sums: dict[str, float | torch.Tensor] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)

    def add(self, metrics: dict[str, float | torch.Tensor], weight: float = 1.0) -> None:
        for key, value in metrics.items():
            value = value.detach().double() if torch.is_tensor(value) else float(value)
            self.sums[key] = self.sums[key] + value * weight
            self.weights[key] += weight

    def result(self) -> dict[str, float]:
        """Global means (a collective: every rank calls it, with the same metric names)."""
        keys = sorted(self.sums)
        sums = [float(self.sums[k]) for k in keys]
        values = torch.tensor([sums, [self.weights[k] for k in keys]], dtype=torch.float64)
        sums, weights = all_reduce(values).tolist() if keys else ([], [])
        return {k: s / w for k, s, w in zip(keys, sums, weights) if w > 0}


def local_scale(denominators: dict, mask: torch.Tensor) -> float:
    """Undo the global token denominator, so a micro-batch's loss metric is its own token mean (`mask` on the
    host: no device sync)."""
    return float(denominators["global_num_tokens"]) / max(float(mask.sum()), 1.0)
