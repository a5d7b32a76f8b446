"""The reward model worker: one Ray actor holding a `RewardModelScorer` (stages/rewards/reward_model.py).

Created by the RL trainer only when `rl.reward.reward_model_path` is set. It is one more colocated role
in the run's placement group, on bundle 0 (device 0 on GPU machines, with that role's share of it), like
the critic; it runs no torch.distributed world. On CUDA it loads the model in `model.dtype`, on CPU in
fp32. The driver sends it (prompt chat messages, response text) pairs and gets one score per pair.
"""

from __future__ import annotations

import torch

from infra.config import Config
from stages.model.loading import DTYPES
from stages.rewards.reward_model import RewardModelScorer


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
