"""The reward model worker: one Ray actor holding a `RewardModelScorer` (stages/rewards/reward_model.py).

Created by the RL trainer only when `rl.reward.reward_model_path` is set. It is one more colocated role
in the run's placement group, on bundle 0 (device 0 on GPU machines, with that role's share of it), like
the critic; it runs no torch.distributed world. On CUDA it loads the model in `model.dtype`, on CPU in
fp32. The driver holds a `RewardModel` (its handle) and sends it (prompt chat messages, response text) pairs;
it gets one score per pair.
"""

from __future__ import annotations

import torch

from infra.config import Config
from stages.model.loading import DTYPES
from stages.rewards.reward_model import RewardModelScorer
from stages.workers.group import Placement


class RewardModelWorker:
    def __init__(self, cfg: Config):
        reward = cfg.rl.reward
        if reward.reward_model_path is None:
            raise ValueError("rl.reward.reward_model_path is not set; the reward model worker needs a model")
        cuda = torch.cuda.is_available()
        self.scorer = RewardModelScorer(reward.reward_model_path, "cuda" if cuda else "cpu",
                                        DTYPES[cfg.model.dtype] if cuda else torch.float32,
                                        reward.reward_model_batch_size)

    def score(self, prompts: list[list[dict]], responses: list[str]) -> list[float]:
        return self.scorer.score(prompts, responses)


class RewardModel:
    """The driver's handle on the reward model's Ray actor, on bundle 0 with one role's share (like a critic rank)."""

    def __init__(self, cfg: Config, placement: Placement):
        import ray

        self.handle = ray.remote(**placement.share)(RewardModelWorker).options(
            scheduling_strategy=placement.strategy(0)).remote(cfg)
        try:
            ray.get(self.handle.__ray_ready__.remote())  # a bad path or a model without a reward head fails here
        except BaseException:
            self.kill()
            raise

    def score(self, prompts: list[list[dict]], responses: list[str]) -> list[float]:
        """One score per (chat messages, response) pair."""
        import ray

        return ray.get(self.handle.score.remote(prompts, list(responses)))

    def kill(self) -> None:
        import ray

        ray.kill(self.handle)
