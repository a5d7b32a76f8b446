"""A rollout worker on a device of its own: only an engine, fed with weights by the trainer (asynchronous modes).

With `ray.rollout_devices_per_node` > 0 the trainer's workers build no engine; R of these generate instead.
They form their own torch.distributed world (vLLM joins it as an external launcher, as on the trainer's side)
and receive weights through a `WeightGroup` with the trainer's rank 0 (stages/workers/weight_transfer.py). The
engine stays awake: nothing else shares its device.
"""

from __future__ import annotations

import time

import torch

from infra.config import Config
from stages.model.fsdp import init_process_group
from stages.rollout.base import PackedOutputs, SamplingParams
from stages.workers.actor_rollout import make_engine
from stages.workers.memory import MemoryPeaks, measured
from stages.workers.weight_transfer import WeightGroup, WeightMeta


class RolloutWorker:
    def __init__(self, cfg: Config, model_dir: str, rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int | None = None):
        self.cfg, self.rank = cfg, rank
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        init_process_group(rank, world_size, master_addr, master_port)  # first: vLLM joins this world
        self.memory = MemoryPeaks(self.device, scope="/rollout")
        self.engine = make_engine(cfg, model_dir)
        self.engine.wake()
        self.weights: WeightGroup | None = None

    def hold_engine_awake(self, awake: bool) -> None:
        """The engine is always awake here (nothing else uses the device)."""

    @measured("gen")
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> PackedOutputs:
        return PackedOutputs.pack(self.engine.generate(prompt_ids, params))  # arrays for the driver, as the actor's

    def engine_param_count(self) -> int:
        return self.engine.param_count()

    def open_weight_group(self, addr: str, port: int, size: int) -> None:
        """Join the trainer's broadcast group as rank 1 + this worker's rank."""
        self.weights = WeightGroup(addr, port, 1 + self.rank, size, self.device,
                                   self.cfg.rl.async_training.rollout_timeout_s)

    def close_weight_group(self) -> None:
        """Leave the broadcast group (with the trainer's rank 0 and the other rollout workers: collective)."""
        if self.weights is not None:
            self.weights.close()
            self.weights = None

    @measured("receive")
    def receive_weights(self, meta: WeightMeta) -> float:
        """Load the trainer's pushed weights into the engine as they arrive; -> seconds taken."""
        start = time.perf_counter()
        self.engine.update_weights(self.weights.receive(meta))
        return time.perf_counter() - start

    def memory_metrics(self) -> dict[str, float]:
        """Peak device memory of each phase since the last call, the largest over the rollout workers (a collective
        of their world: every worker calls it, while none generates)."""
        return self.memory.metrics()
