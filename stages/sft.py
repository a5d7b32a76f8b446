"""SFT warm-start: next-token loss on response tokens only, runnable without Prefect.

Each optimizer step takes `sft.train_batch_size` sequences, split into micro-batches of
`sft.micro_batch_size` with gradient accumulation. The loss is a token mean over the whole global batch:
every micro-batch divides its summed token losses by the batch's total loss-token count, so the
gradient does not depend on how the batch is split. The epoch's sample order is a permutation seeded by
(run.seed, epoch), so a run resumed from a checkpoint at step s sees exactly the batches it would have.

The loss goes through the RL actor's token-logprob module (`sft_policy`): the same packed rows, chunked
vocabulary projection and, on CUDA, compiled layers and Triton head as the RL update. On one device (the run's
`ray.num_devices_per_node * ray.num_nodes` is 1) it trains in this process with fp32 master weights and autocast;
with `sft.offload`, sharded by FSDP2 in a world of this one process with the weights, gradients and optimizer state
in host memory. On N devices, N `SFTTrainer` Ray actors (one per device, as the RL workers are placed) shard it by
FSDP2: rank r takes every N-th sequence of each batch, every micro-batch divides by the whole batch's token count
and gradients are summed over ranks, so the step is the one-device step (tests/integration/test_sft_ranks.py).
Sharded runs compute in model.dtype through FSDP2's mixed precision and checkpoint DCP folders. The rows' tokens and
the batches' layout are stages/sft_data.py's.
"""

from __future__ import annotations

import logging
import math
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from infra.config import Config
from infra.tracking import Tracker, progress_bar
from stages.agent.rollout import load_rollout_tools, tool_schemas
from stages.batch import Batch, to_device
from stages.merge import write_hf_folder
from stages.model.fsdp import (
    full_state_dict,
    hf_weights,
    init_process_group,
    load_train_state,
    save_train_state,
    shard,
)
from stages.model.loading import DTYPES, compute_dtype, load_model, load_tokenizer, save_hf_folder
from stages.model.optim import build_optimizer, build_scheduler, clipped_step
from stages.model.packing import host_inputs, packing_unsupported
from stages.model.policy import TokenLogprobs, compile_layers, head_problem
from stages.model.rng import rng_state, set_rng_state
from stages.model.safe_load import load_state
from stages.sft_data import SFTExample, num_target_tokens, sft_batch, tokenize_sft

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "train_state.pt"
SHARDED_DIR = "train"  # sft.offload: the DCP folder of weights, optimizer and scheduler beside CHECKPOINT_FILE


class Checkpoints(Protocol):
    """Where a stage keeps its checkpoints (the artifact store in the pipeline, a folder in tests)."""

    tmp_dir: Path | None  # where the stage writes a checkpoint before `save` (None: the system's temp folder)

    def latest(self) -> Path | None: ...

    def save(self, step: int, local_dir: Path) -> None: ...


@dataclass
class SFTResult:
    model_dir: Path
    num_steps: int
    final_metrics: dict[str, float]


def sft_policy(model: torch.nn.Module, cuda: bool) -> TokenLogprobs:
    """The model as SFT trains it: the RL actor's token-logprob module (the vocabulary projected in chunks, so
    full-vocabulary logits never exist for the whole micro-batch). On CUDA, as the actor's automatic settings:
    rows packed without padding where the architecture allows, compiled layers and head (on a CPU the padded
    batch is faster: the packed attention loops over sequences there)."""
    if cuda:
        compile_layers(model)
    packs = packing_unsupported(model.config) is None and head_problem(model) is None
    return TokenLogprobs(model, pack=cuda and packs, compile_head=cuda)


def summed_token_nll(policy: TokenLogprobs, batch: Batch, device: torch.device | None = None) -> torch.Tensor:
    """Sum over the loss tokens of -log p(token | prefix), on `device` (default: the model's)."""
    device = device or next(policy.parameters()).device
    logprobs, _ = policy(**to_device(host_inputs(batch, policy.pack), device))
    return -(logprobs * batch.response_mask.to(device)).sum()


def train_step(policy: TokenLogprobs, optimizer, examples: list[SFTExample], micro_batch_size: int,
               grad_clip: float, pad_id: int, device: torch.device | None = None, global_tokens: int | None = None):
    """One optimizer step over a global batch with gradient accumulation; returns (loss, grad_norm). `device`:
    where the batch goes (default: the model's; sft.offload keeps the model in host memory, computes on the GPU).
    `global_tokens`: the loss tokens of the whole batch when `examples` are one rank's share of it (default: theirs);
    the loss returned is then this share's part of the batch's token mean."""
    global_tokens = global_tokens or num_target_tokens(examples)
    losses = []
    starts = range(0, len(examples), micro_batch_size)
    sync = getattr(policy, "set_requires_gradient_sync", None)  # FSDP2 (sft.offload): reduce and offload once
    for start in starts:
        if sync is not None:
            sync(start == starts[-1])
        batch = sft_batch(examples[start : start + micro_batch_size], pad_id)
        loss = summed_token_nll(policy, batch, device) / global_tokens
        loss.backward()
        losses.append(loss.detach())
    grad_norm, _ = clipped_step(policy, optimizer, grad_clip)  # no step on a non-finite norm: NaN weights stay out
    return torch.stack(losses).sum(), grad_norm


def epoch_order(num_examples: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_examples, generator=generator).tolist()


def run_sft(cfg: Config, model_dir: Path, data_dir: Path, out_dir: Path, checkpoints: Checkpoints,
            tracker: Tracker) -> SFTResult:
    """Train from `model_dir` on `data_dir`/sft_*.parquet; the final HF folder goes to `out_dir`."""
    tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
    tools = tool_schemas(load_rollout_tools(cfg.rl.multi_turn))  # a tool_agent row's prompt as RL's
    train = tokenize_sft(data_dir / "sft_train.parquet", tokenizer, cfg.data, tools)
    val = tokenize_sft(data_dir / "sft_validation.parquet", tokenizer, cfg.data, tools)
    steps_per_epoch = len(train) // cfg.sft.train_batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"sft.train_batch_size={cfg.sft.train_batch_size} > {len(train)} training examples")
    total_steps = cfg.sft.epochs * steps_per_epoch
    left = len(train) % cfg.sft.train_batch_size
    if left:
        logger.info("sft: each epoch trains %d of %d examples (%d whole batches of sft.train_batch_size=%d; the "
                    "last %d wait for a later epoch's order, as verl's drop_last)", len(train) - left, len(train),
                    steps_per_epoch, cfg.sft.train_batch_size, left)
    with _ranks(cfg, str(model_dir), total_steps) as ranks:
        loop = _Loop(cfg, ranks, tracker, checkpoints)
        step = loop.resume()
        metrics = loop.run(train, val, step, steps_per_epoch, total_steps)
        ranks.all("export", str(out_dir))
    return SFTResult(out_dir, total_steps, metrics)


def sharded(cfg: Config) -> bool:
    """Whether SFT trains FSDP2 shards (DCP checkpoints): offloaded, or on several devices."""
    return cfg.sft.offload or cfg.ray.num_trainers > 1


class SFTTrainer:
    """One SFT rank: the policy, its optimizer and schedule. In the stage's process when the run has one device
    (`ray.num_devices_per_node * ray.num_nodes`), else rank r of that many Ray actors, one device each, the policy
    sharded by FSDP2 over them (data parallel: each rank takes its share of every batch; gradients are summed).

    fp32 master weights on the GPU when there is one, forwards in model.dtype when it is lower (autocast); when
    sharded (several ranks, or sft.offload: then a world of this one process, weights, gradients and optimizer
    state in host memory with each layer brought to the GPU) by FSDP2's mixed precision instead."""

    def __init__(self, cfg: Config, model_dir: str, rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int | None = None):
        self.cfg, self.model_dir, self.rank, self.world_size = cfg, model_dir, rank, world_size
        self.sharded = sharded(cfg)  # world_size is cfg.ray.num_trainers
        self.joined = self.sharded and not dist.is_initialized()  # a world this rank made, and leaves in close()
        if self.sharded:
            init_process_group(rank, world_size, master_addr, master_port)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = compute_dtype(cfg.model)
        self.tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
        torch.manual_seed(cfg.run.seed)  # the same initial weights (LoRA adapters too) on every rank, and as on one
        model = load_model(model_dir, cfg.model.model_copy(update={"dtype": "float32"}))
        self.model = (model if cfg.sft.offload else model.to(self.device)).train()
        self.policy = sft_policy(self.model, self.device.type == "cuda")
        if self.sharded:
            self.policy = shard(self.policy, param_dtype=self.dtype, offload=cfg.sft.offload)
        self.optimizer = build_optimizer(self.policy.parameters(), cfg.sft.optim)
        self.scheduler = None
        if world_size > 1:
            torch.manual_seed(cfg.run.seed + rank)  # per-rank randomness from here on (dropout)

    def schedule(self, total_steps: int) -> None:
        self.scheduler = build_scheduler(self.optimizer, self.cfg.sft.optim, total_steps)

    def step(self, examples: list[SFTExample], global_tokens: int) -> tuple[float, float, float]:
        """One optimizer step on this rank's share of a batch whose loss tokens number `global_tokens`: (its part of
        the loss, the gradient norm, the learning rate it stepped with)."""
        sft, lr = self.cfg.sft, self.scheduler.get_last_lr()[0]
        with self._autocast():
            loss, grad_norm = train_step(self.policy, self.optimizer, examples, sft.micro_batch_size,
                                         sft.optim.grad_clip, self.tokenizer.pad_token_id, self.device, global_tokens)
        self.scheduler.step()
        grad_norm = float(grad_norm)
        if not math.isfinite(grad_norm):
            logger.warning("sft: gradient norm %s at lr %.3g: step skipped, the weights are unchanged", grad_norm, lr)
        return float(loss), grad_norm, lr

    @torch.no_grad()
    def validation_sum(self, examples: list[SFTExample], real: int) -> float:
        """Summed token loss of the first `real` examples (the rest pad this rank's share to the others' length:
        sharded, every rank must run as many forwards)."""
        micro, total = self.cfg.sft.micro_batch_size, 0.0
        self.policy.eval()
        with self._autocast():
            for start in range(0, len(examples), micro):
                batch = sft_batch(examples[start : start + micro], self.tokenizer.pad_token_id)
                batch.response_mask[max(0, real - start) :] = 0
                total += float(summed_token_nll(self.policy, batch, self.device))
        self.policy.train()
        return total

    def save(self, folder: str) -> dict:
        """Sharded: the DCP folder of weights, optimizer and scheduler (all ranks write their shards); else their
        state dicts, returned for the checkpoint's file."""
        if self.sharded:
            save_train_state(Path(folder) / SHARDED_DIR, self.policy, self.optimizer, self.scheduler)
            if self.world_size > 1:  # a Ray actor's own generator (one device: the driver saves this process's)
                torch.save(rng_state(), Path(folder) / f"rng_rank{self.rank}.pt")
            return {}
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load(self, folder: str) -> None:
        if self.sharded:
            load_train_state(Path(folder) / SHARDED_DIR, self.policy, self.optimizer, self.scheduler)
            rng = Path(folder) / f"rng_rank{self.rank}.pt"
            if self.world_size > 1 and rng.is_file():  # absent when another number of ranks wrote the checkpoint
                set_rng_state(load_state(rng))
            return
        state = load_state(Path(folder) / CHECKPOINT_FILE, mmap=True)  # tensors and plain values: it cannot run code
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def export(self, out_dir: str) -> None:
        """The trained model as an HF folder in model.dtype (sharded: gathered to rank 0, which writes it)."""
        model = self.cfg.model
        if not self.sharded:
            save_hf_folder(self.model.to("cpu", DTYPES[model.dtype]), self.tokenizer, out_dir)
            return
        state = full_state_dict(self.policy)  # a collective: every rank calls it, rank 0 gets the tensors
        if self.rank == 0:
            state = hf_weights(state, model.lora.alpha / model.lora.rank if model.lora else None)
            write_hf_folder({k: v.to(DTYPES[model.dtype]) for k, v in state.items()}, self.model_dir, Path(out_dir),
                            model.trust_remote_code)

    def close(self) -> None:
        if self.joined:
            dist.destroy_process_group()

    def _autocast(self):
        lower = self.dtype is not None and not self.sharded
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=lower)


class _Ranks:
    """The stage's SFT ranks as one: an SFTTrainer in this process, or a WorkerGroup of them."""

    def __init__(self, local: SFTTrainer | None = None, group=None):
        self.local, self.group = local, group
        self.size = 1 if group is None else group.world_size

    def all(self, method: str, *args) -> list:
        if self.group is None:
            return [getattr(self.local, method)(*args)]
        return self.group.call(method, *args)

    def each(self, method: str, per_rank_args: list[tuple]) -> list:
        if self.group is None:
            return [getattr(self.local, method)(*per_rank_args[0])]
        return self.group.call_each(method, per_rank_args)

    def step(self, examples: list[SFTExample]) -> tuple[float, float, float]:
        """(loss, gradient norm, learning rate) of one optimizer step on `examples`, rank r taking every size-th."""
        tokens = num_target_tokens(examples)
        parts = self.each("step", [(examples[r :: self.size], tokens) for r in range(self.size)])
        return sum(p[0] for p in parts), parts[0][1], parts[0][2]

    def validation_loss(self, examples: list[SFTExample]) -> float:
        shares = [examples[r :: self.size] for r in range(self.size)]
        longest = max(len(s) for s in shares)
        padded = [(s + [examples[0]] * (longest - len(s)), len(s)) for s in shares]
        return sum(self.each("validation_sum", padded)) / num_target_tokens(examples)


@contextmanager
def _ranks(cfg: Config, model_dir: str, total_steps: int):
    """One SFTTrainer here when the run has one device, else one per device as Ray actors (on this stage's own Ray
    or `ray.address`'s cluster; released after, and Ray shut down if this call started it)."""
    world = cfg.ray.num_trainers
    if world == 1:
        trainer = SFTTrainer(cfg, model_dir)
        try:
            trainer.schedule(total_steps)
            yield _Ranks(local=trainer)
        finally:
            trainer.close()
        return
    import ray

    from stages.workers.group import Placement, WorkerGroup, init_ray

    started, placement, group = init_ray(cfg.ray), None, None
    try:
        placement = Placement(cfg.ray, num_roles=1)
        group = WorkerGroup(SFTTrainer, cfg, model_dir, placement)
        group.call("schedule", total_steps)
        logger.info("sft: %d ranks (FSDP2 data parallel), %d sequences each per step", world,
                    cfg.sft.train_batch_size // world)
        yield _Ranks(group=group)
    finally:
        if group is not None:
            group.kill()
        if placement is not None:
            placement.remove()
        if started:
            ray.shutdown()


@dataclass
class _Loop:
    cfg: Config
    ranks: _Ranks
    tracker: Tracker
    checkpoints: Checkpoints

    def run(self, train, val, step, steps_per_epoch, total_steps) -> dict[str, float]:
        sft = self.cfg.sft
        val_freq = sft.val_freq or steps_per_epoch
        save_freq = sft.save_freq or steps_per_epoch
        metrics: dict[str, float] = {}
        bar = progress_bar(total_steps, step, "sft")
        while step < total_steps:
            epoch, pos = divmod(step, steps_per_epoch)
            order = epoch_order(len(train), self.cfg.run.seed, epoch)
            batch = [train[i] for i in order[pos * sft.train_batch_size : (pos + 1) * sft.train_batch_size]]
            loss, grad_norm, lr = self.ranks.step(batch)
            step += 1
            metrics = {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm, "train/epoch": epoch}
            if step % val_freq == 0 or step == total_steps:
                metrics["val/loss"] = self.ranks.validation_loss(val)
            self.tracker.log(metrics, step)
            bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", refresh=False)  # redrawn on the bar's own clock
            bar.update()
            if step % save_freq == 0 and step < total_steps:
                self._save(step)
        bar.close()
        return metrics

    def _save(self, step: int) -> None:
        with tempfile.TemporaryDirectory(dir=self.checkpoints.tmp_dir) as tmp:
            state = {"step": step, "rng": rng_state(), **self.ranks.all("save", tmp)[0]}
            torch.save(state, Path(tmp) / CHECKPOINT_FILE)
            self.checkpoints.save(step, Path(tmp))

    def resume(self) -> int:
        latest = self.checkpoints.latest()
        if latest is None:
            return 0
        shards = sharded(self.cfg)
        if shards != (latest / SHARDED_DIR).is_dir():
            held, trains = ("one unsharded state", "sharded") if shards else ("DCP shards", "unsharded on one device")
            raise RuntimeError(
                f"sft: the checkpoint to resume ({latest.name}) holds {held}, but this run trains {trains}: runs with "
                "sft.offload=true or ray.num_devices_per_node * ray.num_nodes > 1 resume sharded checkpoints (written "
                "by any number of ranks), others unsharded ones. Resume with the settings that wrote it, or remove "
                "this configuration's sft checkpoints (`python -m infra.store delete checkpoint/NAME@VERSION`) to "
                "start over")
        # tensors and plain values only: a checkpoint cannot run code; mapped, not read (the step and generator only)
        state = load_state(latest / CHECKPOINT_FILE, mmap=True)
        self.ranks.all("load", str(latest))
        set_rng_state(state["rng"])
        logger.info("sft: resumed from checkpoint at step %d", state["step"])
        return int(state["step"])
