"""The critic worker (PPO with GAE): a value head on the policy's architecture, FSDP2-sharded.

Initialised from the same model folder as the actor, with a zero-initialised value head. Values are
read at the positions that predict each response token (see ValueModel). The loss is verl's clipped
value loss, with the same global denominators as the actor (summed over ranks) so neither micro-batching
nor the number of workers changes it. N critic workers form their own torch.distributed world, colocated
with the actor workers (rank r of both on device r).
"""

from __future__ import annotations

from pathlib import Path

import torch

from infra.config import Config
from stages.batch import Batch, to_device
from stages.core import clipped_value_loss
from stages.model.fsdp import init_process_group, load_train_state, reshard, save_train_state, shard
from stages.model.loading import compute_dtype, load_model
from stages.model.optim import build_optimizer, build_scheduler
from stages.model.policy import ValueModel
from stages.workers.actor_update import (
    MetricMeans,
    accumulate,
    clipped_step,
    global_denominators,
    local_mini_rows,
    local_scale,
    micro_batches,
    reshard_after_forward,
)


class CriticWorker:
    def __init__(self, cfg: Config, model_dir: str, rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int | None = None):
        self.cfg = cfg
        self.critic_cfg = cfg.rl.critic
        torch.manual_seed(cfg.run.seed + 1000)  # the same initial weights on every rank
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        init_process_group(rank, world_size, master_addr, master_port)
        model_cfg = cfg.model.model_copy(update={"lora": None, "gradient_checkpointing": False, "dtype": "float32"})
        value_model = ValueModel(load_model(model_dir, model_cfg)).to(self.device)  # fp32 master weights
        reshard = reshard_after_forward(self.critic_cfg, value_model)
        self.model = shard(value_model, compute_dtype(cfg.model), reshard)
        optim = self.critic_cfg.optim()
        self.optimizer = build_optimizer(self.model.parameters(), optim)
        self.scheduler = build_scheduler(self.optimizer, optim, cfg.rl.total_steps)

    def _inputs(self, values: Batch | dict) -> dict:
        return to_device(values.model_inputs() if isinstance(values, Batch) else values, self.device)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        self.model.eval()
        values = torch.zeros(len(batch), batch.num_response_tokens)
        for rows in micro_batches(batch, self.critic_cfg):
            values[rows] = self.model(**self._inputs(batch.select(rows))).float().cpu()
        reshard(self.model)
        return values * batch.response_mask

    def update(self, batch: Batch) -> dict[str, float]:
        self.model.train()
        cfg = self.critic_cfg
        mini_size = local_mini_rows(self.cfg)
        means = MetricMeans()
        for _ in range(cfg.ppo_epochs):
            for start in range(0, len(batch), mini_size):
                mini = batch.select(list(range(start, min(start + mini_size, len(batch)))))
                self._update_mini(mini, means)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return {**means.result(), "critic/lr": lr}

    def _update_mini(self, mini: Batch, means: MetricMeans) -> None:
        scale = {**global_denominators(mini.response_mask), "max_response_length": self.cfg.data.max_response_length}
        for rows in accumulate(self.model, micro_batches(mini, self.critic_cfg), self.critic_cfg):
            micro = mini.select(rows)
            t = self._inputs({k: micro.tensors[k] for k in ("values", "returns", "response_mask")})
            values = self.model(**self._inputs(micro))
            loss, metrics = clipped_value_loss(values, t["values"], t["returns"], t["response_mask"],
                                               self.critic_cfg.cliprange_value, self.cfg.rl.actor.loss_agg_mode,
                                               **scale)
            loss.backward()
            local = loss.detach() * local_scale(scale, micro.response_mask)
            means.add({"critic/vf_loss": local, **metrics}, weight=float(micro.response_mask.sum()))
        norm, _ = clipped_step(self.model, self.optimizer, self.critic_cfg.grad_clip)
        means.add({"critic/grad_norm": norm})

    def save_checkpoint(self, path: str) -> None:
        """Sharded into `path`/critic (see ActorRolloutWorker.save_checkpoint)."""
        save_train_state(Path(path) / "critic", self.model, self.optimizer, self.scheduler)

    def load_checkpoint(self, path: str) -> None:
        load_train_state(Path(path) / "critic", self.model, self.optimizer, self.scheduler)
