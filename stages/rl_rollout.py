"""The RL driver's generation side: prompts -> the engines' samples -> scored batches.

`RolloutDriver.generate_and_score` is one synchronous step's batch (DAPO dynamic sampling generates more batches
until `train_batch_size` groups have varied rewards); `generate` is one chunk of it, which the asynchronous modes'
producer (stages/rl_async.py) calls on its own thread. Generation goes through the agent loops (stages/agent) to
the engines, data-parallel over engine groups of `tensor_model_parallel_size` ranks (prompts that continue a parked
prefix go back to the engine that parked it); scoring is the reward pool (process pool with timeouts), plus the
reward model's weighted score, plus DAPO's overlong penalty; ReMax adds each prompt's greedy score as baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch

from infra.config import Config
from stages.agent import Rollout, Scored
from stages.batch import Batch, rank_rows
from stages.data_prep import PromptSet
from stages.rewards.overlong import overlong_penalty
from stages.rewards.pool import RewardPool
from stages.rl_data import (
    PromptSampler,
    average_metrics,
    concat_batches,
    rollout_batch,
    rollout_metrics,
    signal_metrics,
    varied_rows,
)
from stages.rollout.base import PackedOutputs, RolloutOutput, SamplingParams
from stages.workers.actor_rollout import prefix_router
from stages.workers.group import WorkerGroup
from stages.workers.reward_model import RewardModel

Generate = Callable[[list[list[int]], SamplingParams], Sequence[RolloutOutput]]


class RolloutDriver:
    """Generation and scoring for the RL trainer: `engines` are the colocated actor group or rollout workers of
    their own; `versioned_generate` (set by the asynchronous modes before their producer starts) wraps the
    engines' generate with policy versions and partial rollouts."""

    def __init__(self, cfg: Config, tokenizer, train: PromptSet, engines: WorkerGroup,
                 reward_model: RewardModel | None, tools, interactions, stop_ids: tuple[int, ...]):
        self.cfg, self.rl = cfg, cfg.rl
        self.tokenizer, self.train, self.engines, self.reward_model = tokenizer, train, engines, reward_model
        self.stop_ids = stop_ids  # the model's EOS ids (stages.model.loading.stop_token_ids)
        self.sampler = PromptSampler(len(train), self.rl.train_batch_size, cfg.run.seed)
        self.rewards = RewardPool(self.rl.reward, min_judged=self.rl.train_batch_size * self.rl.rollout.n)
        self.prefix_router = prefix_router(cfg, engines.world_size // self.rl.rollout.tensor_model_parallel_size)
        self.versioned_generate: Generate | None = None
        self.rollout = Rollout(self._rollout_generate, tokenizer, self.rewards, tools, self.rl.multi_turn,
                               interactions)

    def generate_and_score(self, step: int, timer) -> tuple[Batch, dict[str, float]]:
        """A scored batch of train_batch_size groups (more generations when filtering groups)."""
        alg = self.rl.algorithm
        kept, num_groups, gen, generated, reward_metrics = [], 0, 0, [], []
        while num_groups < self.rl.train_batch_size:
            if alg.filter_groups and alg.max_num_gen_batches and gen >= alg.max_num_gen_batches:
                raise RuntimeError(
                    f"dynamic sampling found {num_groups}/{self.rl.train_batch_size} groups with varied rewards "
                    f"after {gen} generation batches; raise rl.algorithm.max_num_gen_batches or check the reward")
            batch, metrics = self.generate(self.sampler.indices(step, extra=gen), f"{step}-{gen}",
                                           self.batch_seed(step, gen), timer)
            gen += 1
            generated.append(batch)
            reward_metrics.append(metrics)
            if alg.filter_groups:
                batch = self.varied_groups(batch)
            kept.append(batch)
            num_groups += len(set(batch.meta["group_id"]))
        batch = kept[0] if len(kept) == 1 else concat_batches(kept, self.tokenizer.pad_token_id)
        groups = list(dict.fromkeys(batch.meta["group_id"]))[: self.rl.train_batch_size]
        batch = batch.select([i for i, g in enumerate(batch.meta["group_id"]) if g in set(groups)])
        return batch, {"train/num_gen_batches": gen, **average_metrics(reward_metrics), **signal_metrics(generated),
                       **rollout_metrics(generated)}

    def batch_seed(self, step: int, offset: int) -> int:
        """The sampling seed of generation batch `offset` of `step` (the synchronous loop's dynamic-sampling batch,
        or the position of an asynchronous chunk's first group in its step): distinct while offset < the stride.
        The stride stays 1000 up to 1000 groups a step, so runs recorded before it grew keep their samples."""
        return step * max(1000, self.rl.train_batch_size) + offset

    def generate(self, indices: list[int], group_prefix: str, seed: int, timer) -> tuple[Batch, dict[str, float]]:
        """The scored samples of prompt rows `indices` (n each), and the reward metrics."""
        ro = self.rl.rollout
        params = SamplingParams(n=ro.n, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                                max_tokens=self.cfg.data.max_response_length,
                                stop_token_ids=self.stop_ids, seed=self.cfg.run.seed * 7 + seed)
        with self.engines_awake():
            trajectories = self.rollout.run(self.train, indices, params)
        batch = rollout_batch(self.train, indices, trajectories, group_prefix, self.tokenizer.pad_token_id)
        with timer("reward"):
            metrics = self.score(batch, self.rollout.score(self.train, indices, trajectories))
            if self.rl.algorithm.adv_estimator.needs_greedy_baseline:
                batch.tensors["reward_baselines"] = self._greedy_baselines(batch, indices)
        return batch, metrics

    def _rollout_generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[RolloutOutput]:
        """What the rollout calls: the engines, or (asynchronous modes) the producer's versioned generate."""
        return (self.versioned_generate or self.engine_generate)(prompt_ids, params)

    @contextmanager
    def engines_awake(self):
        """One engine wake for every generate call of a rollout (multi-turn loops call once per turn)."""
        self.engines.call("hold_engine_awake", True)
        try:
            yield
        finally:
            self.engines.call("hold_engine_awake", False)

    def engine_generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Sequence[RolloutOutput]:
        """Data-parallel generation: engine g (ranks g*tp .. g*tp+tp-1, tp = tensor_model_parallel_size; every
        rank of a group gets the same prompts and seed) samples its consecutive share of the prompts;
        outputs (the group's first rank's) come back prompt-major with indices into `prompt_ids`. With prefix
        reuse on several cuda engines, a prompt that continues a sequence an engine parked goes to that engine."""
        tp, ranks = self.rl.rollout.tensor_model_parallel_size, self.engines.world_size
        engines = ranks // tp
        router = self.prefix_router
        shards = router.shards(prompt_ids) if router else rank_rows(len(prompt_ids), engines, max(1, len(prompt_ids)))
        seeds = [None if params.seed is None else params.seed + 1_000_003 * g for g in range(engines)]
        calls = [([prompt_ids[i] for i in shards[r // tp]], replace(params, seed=seeds[r // tp])) for r in range(ranks)]
        results = self.engines.call_each("generate", calls)[::tp]  # PackedOutputs: arrays, not token objects
        outputs = PackedOutputs.concat(results, shards)
        if router is None:
            return outputs
        router.record(shards, prompt_ids, results)
        return sorted(outputs, key=lambda o: o.prompt_index)  # stable: each prompt's n samples keep their order

    def score(self, batch: Batch, scored: Scored) -> dict[str, float]:
        """The batch's scores (reward function + tools, + the reward model) and rewards (+ overlong penalty);
        -> the reward metrics."""
        reward, result = self.rl.reward, scored.result
        scores = torch.tensor(scored.scores, dtype=torch.float32)
        if self.reward_model:  # score = rule + weight * rm; the raw RM score is the component "rm"
            rm = self.rm_scores(batch.meta["prompt_row"], batch.meta["response"])
            scores = scores + reward.reward_model_weight * torch.tensor(rm, dtype=torch.float32)
            result.components["rm"] = rm
            result.metrics["reward/rm/mean"] = sum(rm) / max(len(rm), 1)
        lengths = batch.response_lengths().tolist()  # tool and user tokens too, as verl counts them
        penalty = torch.tensor(overlong_penalty(lengths, self.cfg.data.max_response_length, reward.overlong_buffer,
                                                reward.overlong_penalty_factor), dtype=torch.float32)
        batch.tensors["scores"], batch.tensors["rewards"] = scores, scores + penalty
        for name, values in result.components.items():
            batch.meta[f"reward_{name}"] = values
        return {**result.metrics, "reward/overlong_penalty/mean": float(penalty.mean())}

    def _greedy_baselines(self, batch: Batch, indices: list[int]) -> torch.Tensor:
        """ReMax: each sample's baseline is the reward of its prompt's greedy response, as `score` rewards the
        samples (reward model and overlong penalty included), so a sample equal to it has advantage 0."""
        reward, max_length = self.rl.reward, self.cfg.data.max_response_length
        params = SamplingParams(n=1, temperature=0.0, max_tokens=max_length, stop_token_ids=self.stop_ids)
        with self.engines_awake():
            trajectories = self.rollout.run(self.train, indices, params)
        greedy = self.rollout.score(self.train, indices, trajectories).scores
        if self.reward_model:
            rm = self.rm_scores([indices[t.prompt_index] for t in trajectories], [t.text for t in trajectories])
            greedy = [s + reward.reward_model_weight * r for s, r in zip(greedy, rm)]
        penalty = overlong_penalty([len(t.response_ids) for t in trajectories], max_length, reward.overlong_buffer,
                                   reward.overlong_penalty_factor)
        by_row = {indices[t.prompt_index]: s + p for t, s, p in zip(trajectories, greedy, penalty, strict=True)}
        return torch.tensor([by_row[r] for r in batch.meta["prompt_row"]], dtype=torch.float32)

    def varied_groups(self, batch: Batch) -> Batch:
        """DAPO dynamic sampling: keep groups whose filter metric is not the same for every sample."""
        metric, scores = self.rl.algorithm.filter_groups_metric, batch.tensors["scores"].tolist()
        values = {"score": scores, "seq_reward": batch.tensors["rewards"].tolist()}.get(
            metric, batch.meta.get("reward_acc", scores))
        return batch.select(varied_rows(batch.meta["group_id"], [float(v) for v in values], scores))

    def rm_scores(self, prompt_rows: list[int], responses: list[str]) -> list[float]:
        """The reward model's score of each (train prompt row's chat messages, response) pair."""
        prompts = [[{"role": m["role"], "content": m["content"]} for m in self.train.prompts[r]] for r in prompt_rows]
        return self.reward_model.score(prompts, responses)

    def close(self) -> None:
        self.rewards.close()
