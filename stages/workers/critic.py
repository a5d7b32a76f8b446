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
from stages.model.fsdp import init_process_group, reshard, shard
from stages.model.loading import compute_dtype, load_model
from stages.model.policy import ValueModel
from stages.workers.train_engine import (
    TrainEngine,
    automatic_fields,
    local_mini_rows,
    local_scale,
    micro_batches,
    resolve_trainer,
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
        self.critic_cfg = resolve_trainer(cfg.rl.critic, value_model)
        self.automatic = automatic_fields(cfg.rl.critic, self.critic_cfg, "rl.critic")
        self.model = shard(value_model, compute_dtype(cfg.model), self.critic_cfg.reshard_after_forward,
                           self.critic_cfg.offload)
        self.trainer = TrainEngine("critic", self.model, self.critic_cfg, cfg.rl.total_steps, local_mini_rows(cfg))

    def automatic_settings(self) -> dict[str, object]:
        return self.automatic

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
        return self.trainer.update(batch, self._loss)

    def _loss(self, micro: Batch, denominators: dict) -> tuple[torch.Tensor, dict]:
        """verl's clipped value loss of one micro-batch, scaled by the mini-batch's global denominators."""
        scale = {**denominators, "max_response_length": self.cfg.data.max_response_length}
        t = self._inputs({k: micro.tensors[k] for k in ("values", "returns", "response_mask")})
        values = self.model(**self._inputs(micro))
        loss, metrics = clipped_value_loss(values, t["values"], t["returns"], t["response_mask"],
                                           self.critic_cfg.cliprange_value, self.cfg.rl.actor.loss_agg_mode, **scale)
        return loss, {"critic/vf_loss": loss.detach() * local_scale(scale, micro.response_mask), **metrics}

    def save_checkpoint(self, path: str) -> None:
        """Sharded into `path`/critic (see ActorRolloutWorker.save_checkpoint)."""
        self.trainer.save(Path(path) / "critic")

    def load_checkpoint(self, path: str) -> None:
        self.trainer.load(Path(path) / "critic")
