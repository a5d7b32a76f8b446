"""The RL stage: verl's single-controller loop (HybridFlow) on Ray workers, runnable without Prefect.

One step: sample prompts -> generate n samples each (vLLM or hf, colocated with the trainer) -> score
(process pool with timeouts, plus `rl.reward.reward_model_weight` times a reward model's score when
`rl.reward.reward_model_path` is set; DAPO dynamic sampling keeps generating until enough groups have varied
rewards) -> old/ref logprobs and values -> advantages on the driver (stages/core registries) -> critic
and actor updates (online DPO: the actor on each group's best and worst sample as a pair) -> weight sync into
the engine, checked against the trainer -> metrics and trajectories to the store -> validation every
`test_freq`, checkpoint every `save_freq`.

The driver holds no model. With N workers (`ray.num_devices_per_node * ray.num_nodes`) it balances each
mini-batch's tokens across them, sends rank r its share (stages/batch.py `rank_rows`), and gathers per-row
results back; prompts are split across the workers' engines for generation.

Resume: the latest checkpoint restores actor/critic/optimizer/scheduler state, the KL controller and RNG;
prompts are a function of the step number, and trajectory partitions written after that checkpoint are
removed, so the resumed run continues exactly, without duplicates.

Output: the checkpoint of the last step (the loop always saves it), not a model folder. The merge stage
(stages/merge.py, `python -m stages.merge --checkpoint REF --out DIR`) turns it into a plain HF folder.
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from infra.artifacts import ArtifactRef
from infra.config import Config
from infra.console import LINES
from infra.learning_signal import WARNING_METRIC, NoSignalMonitor
from infra.tracking import Tracker, progress_bar
from infra.trajectories import RunTables
from stages.agent.rollout import load_rollout_interactions, load_rollout_tools, tool_schemas
from stages.batch import Batch, balance_batch, token_level_scores
from stages.core import AdvantageInputs, apply_kl_penalty, compute_advantages, make_kl_controller
from stages.data_prep import load_prompts
from stages.model.loading import load_tokenizer, stop_token_ids
from stages.model.safe_load import load_state
from stages.rl_async import AsyncSchedule
from stages.rl_correction import corrected_batch
from stages.rl_data import data_metrics, preference_batch, trajectory_rows, turn_rows
from stages.rl_driver import StepTimer, driver_threads
from stages.rl_rollout import RolloutDriver
from stages.rollout.base import SamplingParams
from stages.sft import Checkpoints
from stages.validation import group_metrics, start_summary, validation_samples
from stages.workers.actor_rollout import ActorRolloutWorker
from stages.workers.critic import CriticWorker
from stages.workers.group import Placement, WorkerGroup, free_port_on, init_ray
from stages.workers.reward_model import RewardModel
from stages.workers.rollout_worker import RolloutWorker

logger = logging.getLogger(__name__)


class RLCheckpoints(Checkpoints, Protocol):
    """Where RL keeps its checkpoints: versioned artifacts (infra.checkpoints.StoreCheckpoints)."""

    def at_step(self, step: int) -> ArtifactRef | None: ...

    def clear(self) -> int: ...


@dataclass
class RLResult:
    checkpoint: ArtifactRef  # the final step's checkpoint; stages.merge turns it into an HF folder
    num_steps: int
    final_metrics: dict[str, float]
    automatic: dict[str, object]  # the automatic (None) settings as the workers decided them, by dotted key


def run_rl(cfg: Config, model_dir: str, data_dir: Path, checkpoints: RLCheckpoints, tables: RunTables,
           tracker: Tracker) -> RLResult:
    """Train with RL from `model_dir` on `data_dir`/{train,validation}.parquet; -> the final checkpoint's ref."""
    started_ray = init_ray(cfg.ray)
    trainer, finished = None, False
    try:
        with driver_threads():
            trainer = RLTrainer(cfg, model_dir, data_dir, checkpoints, tables, tracker)
            metrics = trainer.fit()
            finished = True
    finally:
        try:
            if trainer:
                trainer.close(finished)
        finally:
            if started_ray:
                import ray

                ray.shutdown()
    ref = checkpoints.at_step(trainer.step)
    if ref is None:  # fit() saves the last step (or resumed from its checkpoint), so `checkpoints` dropped it
        raise RuntimeError(f"rl: no checkpoint of the final step {trainer.step} after training; "
                           f"{type(checkpoints).__name__}.save must keep it")
    logger.info("rl: %d steps, final checkpoint %s; make a model of it with "
                "`python -m stages.merge [--root STORE] --checkpoint %s --out DIR`", trainer.step, ref, ref)
    return RLResult(ref, trainer.step, metrics, trainer.automatic)


class RLTrainer:
    def __init__(self, cfg: Config, model_dir: str, data_dir: Path, checkpoints: Checkpoints, tables: RunTables,
                 tracker: Tracker):
        self.cfg, self.rl = cfg, cfg.rl
        self.checkpoints, self.tables, self.tracker = checkpoints, tables, tracker
        self.tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
        multi_turn = self.rl.multi_turn  # a bad tools or interactions file fails here, before workers start
        tools, interactions = load_rollout_tools(multi_turn), load_rollout_interactions(multi_turn)
        schemas = tool_schemas(tools)  # rendered into tool_agent prompts, as verl's tool agent loop does
        self.train = load_prompts(data_dir / "train.parquet", self.tokenizer, cfg.data, schemas)
        self.val = load_prompts(data_dir / "validation.parquet", self.tokenizer, cfg.data, schemas)
        self.world_size = cfg.ray.num_devices_per_node * cfg.ray.num_nodes
        self.mini_rows = self.rl.actor.ppo_mini_batch_size * self.rl.rollout.n  # one optimizer step
        self.placement, self.actor, self.critic, self.reward_model, self.engines = None, None, None, None, None
        use_rm = self.rl.reward.reward_model_path is not None
        try:
            self.placement = Placement(cfg.ray, num_roles=1 + self.rl.uses_critic + use_rm)
            self.actor = WorkerGroup(ActorRolloutWorker, cfg, model_dir, self.placement)
            self.engines = self._start_rollout_workers(model_dir) if cfg.ray.num_rollout_workers else self.actor
            self.critic = WorkerGroup(CriticWorker, cfg, model_dir, self.placement) if self.rl.uses_critic else None
            self.reward_model = RewardModel(cfg, self.placement) if use_rm else None
            self.automatic = self._automatic_settings()
            self.gen = RolloutDriver(cfg, self.tokenizer, self.train, self.engines, self.reward_model, tools,
                                     interactions, stop_token_ids(model_dir, self.tokenizer.eos_token_id))
        except BaseException:  # a reward pool that fails to start, Ctrl-C
            self._release_workers()  # a persistent cluster must not keep a half-made group's resources
            raise
        ignored = self.rl.async_training.ignored_fields(bool(cfg.ray.num_rollout_workers))
        if ignored:
            logger.warning("rl: %s not used by rl.async_training.mode=%s%s", ", ".join(ignored),
                           self.rl.async_training.mode, "" if cfg.ray.num_rollout_workers else " (colocated)")
        self.schedule: AsyncSchedule | None = None  # rollout workers of their own: the asynchronous modes
        alg = self.rl.algorithm
        self.kl_ctrl = make_kl_controller(alg.kl_ctrl_type, alg.kl_coef, alg.target_kl, alg.kl_horizon)
        self.no_signal, note = NoSignalMonitor.for_config(self.rl)
        if note:
            logger.warning("rl: %s", note)
        self.warned_dropped_pairs = False
        self.engine_checked = False  # the first weight sync of this process is always checked
        self.step = self.next_group = 0  # next_group: asynchronous modes, the first group no step has taken

    # ---- the loop ----------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        self.resume()
        metrics: dict[str, float] = {}
        if self.step == 0 and self.rl.val_before_train:
            metrics = self.validate(0)
            self.log(metrics, 0)
        if self.engines is not self.actor:
            self.schedule = AsyncSchedule(self, self.next_group, self.step)
        bar = progress_bar(self.rl.total_steps, self.step, "rl")
        while self.step < self.rl.total_steps:
            self.step += 1
            metrics = self.train_step(self.step)
            self.check_signal(metrics)
            if self._due(self.rl.test_freq):
                metrics.update(self.validate(self.step))
            self.log(metrics, self.step)
            if self._due(self.rl.save_freq):
                self.save_checkpoint(self.step)
            bar.update()
            bar.set_postfix(score=f"{metrics.get('critic/score/mean', 0):.3f}")
        bar.close()
        return metrics

    def check_signal(self, metrics: dict[str, float]) -> None:
        """Warn (console, log, and the metric the report and Prefect artifact show) when groups stop differing."""
        warning = self.no_signal.update(self.step, metrics)
        if warning:
            logger.warning("rl: %s", warning)
            metrics[WARNING_METRIC] = float(len(self.no_signal.streak))

    def _due(self, freq: int) -> bool:
        return self.step == self.rl.total_steps or (freq > 0 and self.step % freq == 0)

    def train_step(self, step: int) -> dict[str, float]:
        timer = StepTimer()
        with timer("step"):
            with timer("gen"):  # the asynchronous modes: waiting for the producer's groups
                batch, metrics = (self.schedule.next_batch(step) if self.schedule else
                                  self.gen.generate_and_score(step, timer))
            # the actor's data-parallel parts: a Ulysses group's ranks share one
            parts = self.world_size // self.rl.actor.ulysses_sequence_parallel_size
            batch, seqlen_metrics = balance_batch(batch, parts, self.mini_rows)
            metrics.update(seqlen_metrics)
            if self.rl.algorithm.rollout_correction.bypass_mode:  # verl's bypass: pi_old is the engine's policy
                batch.tensors["old_logprobs"] = batch.tensors["rollout_logprobs"]
            else:
                with timer("old_log_prob"):
                    batch.tensors["old_logprobs"], batch.tensors["entropy"] = self.actor.map_rows(
                        "compute_logprobs", batch, self.mini_rows, "actor", True)
            if self.rl.uses_reference:
                with timer("ref"):
                    batch.tensors["ref_logprobs"], _ = self.actor.map_rows("compute_logprobs", batch, self.mini_rows,
                                                                           "ref")
            if self.critic:
                with timer("values"):
                    batch.tensors["values"] = self.critic.map_rows("compute_values", batch, self.mini_rows)
            with timer("adv"):
                metrics.update(self.compute_advantages(batch))
            train, corr_metrics = corrected_batch(batch, self.rl.algorithm.rollout_correction)  # IS weights, rejection
            metrics.update(corr_metrics)
            if self.critic:
                with timer("update_critic"):
                    metrics.update(self.critic.split_call("update", train, self.mini_rows))
            if step > self.rl.critic.warmup_steps_before_actor:
                with timer("update_actor"):
                    metrics.update(self.update_actor(train))
            with timer("sync"):
                metrics.update(self.schedule.after_update(step) if self.schedule else
                               self.actor.call_one("sync_weights", self.due_check_prompts(step)))
        metrics.update(self.step_metrics(batch, timer))
        metrics.update(self.actor.call_one("memory_metrics"))  # peak device memory by phase
        self.tables.write_rollouts(step, trajectory_rows(batch, self._prompt_texts(batch), step - 1))
        self.tables.write_turns(step, turn_rows(batch))
        return metrics

    def _start_rollout_workers(self, model_dir: str) -> WorkerGroup:
        """Rollout workers on devices of their own, and the broadcast group from the trainer's rank 0 to them."""
        engines = WorkerGroup(RolloutWorker, self.cfg, model_dir, self.placement, rollout=True)
        addr, port = free_port_on(self.placement, 0)
        size = 1 + engines.world_size
        engines.get_all([h.open_weight_group.remote(addr, port, size) for h in self.actor.handles + engines.handles])
        return engines

    def _automatic_settings(self) -> dict[str, object]:
        """The settings left to the workers (None in the config), as rank 0 of each role decided them; logged."""
        decided = dict(self.actor.call_one("automatic_settings"))
        if self.critic:
            decided |= self.critic.call_one("automatic_settings")
        if decided:
            logger.info("rl: automatic settings: %s", ", ".join(f"{k}={v}" for k, v in decided.items()))
        return decided

    # ---- advantages ----------------------------------------------------------------------------------

    def compute_advantages(self, batch: Batch) -> dict[str, float]:
        t, alg, mask = batch.tensors, self.rl.algorithm, batch.response_mask
        t["token_level_scores"] = token_level_scores(t["rewards"], mask)
        metrics: dict[str, float] = {}
        if "ref_logprobs" in t:
            t["kl"] = (t["old_logprobs"] - t["ref_logprobs"]) * mask
        if alg.use_kl_in_reward:
            t["token_level_rewards"], kl_metrics = apply_kl_penalty(
                t["token_level_scores"], t["old_logprobs"], t["ref_logprobs"], mask, self.kl_ctrl.value,
                alg.kl_penalty)
            metrics = {k: float(v) for k, v in kl_metrics.items()}
            self.kl_ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=len(batch))
        else:
            t["token_level_rewards"] = t["token_level_scores"]
        inputs = AdvantageInputs(token_level_rewards=t["token_level_rewards"], response_mask=mask,
                                 index=batch.meta["group_id"], values=t.get("values"),
                                 reward_baselines=t.get("reward_baselines"))
        estimator = alg.adv_estimator
        t["advantages"], t["returns"] = compute_advantages(estimator.name, inputs, **estimator.params())
        return metrics

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """The actor's update on the step's batch, or (online DPO) on its (chosen, rejected) pairs: the rest of
        the step (metrics, trajectories) keeps every sample."""
        if not self.rl.algorithm.adv_estimator.pairwise:
            return self.actor.split_call("update_actor", batch, self.mini_rows)
        pairs, metrics = preference_batch(batch, self.world_size)
        if metrics["dpo/num_pairs_dropped"] and not self.warned_dropped_pairs:
            self.warned_dropped_pairs = True
            logger.warning("rl: online DPO leaves out the pairs beyond a multiple of the %d workers (every worker "
                           "trains on as many pairs); counted in dpo/num_pairs_dropped", self.world_size)
        mini_rows = self.rl.actor.ppo_mini_batch_size * 2
        pairs, _ = balance_batch(pairs, self.world_size, mini_rows, unit_rows=2)
        return {**metrics, **self.actor.split_call("update_actor", pairs, mini_rows)}

    # ---- metrics, validation -----------------------------------------------------------------------

    def step_metrics(self, batch: Batch, timer: StepTimer) -> dict[str, float]:
        metrics = {**data_metrics(batch, self.cfg.data.max_response_length), **timer.metrics}
        mask = batch.response_mask
        diff = (batch.tensors["rollout_logprobs"] - batch.tensors["old_logprobs"]).abs() * mask
        metrics["training/rollout_probs_diff_max"] = float(diff.max())
        tokens = float(batch.tensors["attention_mask"].sum())
        metrics["perf/total_num_tokens"] = tokens
        metrics["perf/throughput"] = tokens / max(timer.metrics["timing_s/step"], 1e-9)
        return metrics

    def validate(self, step: int) -> dict[str, float]:
        """Validation samples (rollout.val_*) into the `validation` table and val/acc/* metrics. Before training
        (step 0) with val_n = 1, also rollout.n samples per prompt at the training temperature: mean@n and
        best@n (pass@n) say how often the starting model can earn a reward, i.e. how much RL can learn from."""
        with self.schedule.current_policy(step) if self.schedule else nullcontext():
            return self._validate(step)

    def _validate(self, step: int) -> dict[str, float]:
        ro = self.rl.rollout
        start = time.perf_counter()
        samples = self._val_samples(SamplingParams(n=ro.val_n, temperature=ro.val_temperature, top_p=ro.val_top_p))
        self.tables.write_validation(step, samples)
        metrics = group_metrics(samples, ro.val_n, "val")
        if step == 0 and ro.val_n == 1 and ro.n > 1:
            sampled = self._val_samples(SamplingParams(n=ro.n, temperature=ro.temperature, top_p=ro.top_p,
                                                       top_k=ro.top_k))
            metrics.update(group_metrics(sampled, ro.n, "val"))
            self._report_start(len(samples), metrics)
        metrics["timing_s/testing"] = time.perf_counter() - start
        return metrics

    def _report_start(self, num_prompts: int, metrics: dict[str, float]) -> None:
        """Say what RL starts from; warn before step 1 when almost every group will be all wrong."""
        ro = self.rl.rollout
        text, pass_n = start_summary(num_prompts, metrics, ro.n, ro.temperature)
        if self.rl.no_signal_steps and 1 - pass_n >= self.rl.no_signal_frac:
            logger.warning("rl: %s: in about %.0f%% of groups no sample will earn the reward, so RL has little to "
                           "learn from; see the advice if the no-signal warning follows", text, 100 * (1 - pass_n))
        else:
            logger.info("rl: %s", text)

    def _val_samples(self, params: SamplingParams) -> list[dict]:
        num = min(len(self.val), self.rl.max_validation_samples or len(self.val))
        params = replace(params, max_tokens=self.cfg.data.max_response_length,
                         stop_token_ids=self.gen.stop_ids, seed=self.cfg.run.seed)
        with self.gen.engines_awake():
            return validation_samples(self.gen.rollout, self.val, list(range(num)), params)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.tables.write_metrics(step, metrics)
        self.tracker.log(metrics, step)

    def due_check_prompts(self, step: int) -> list[list[int]]:
        """The prompts the engines are checked on after the weight sync that follows `step`; none where that sync's
        check is not due (rl.rollout.logprob_check_freq: every k-th step and the last; a process's first sync, a
        resumed run's included, always)."""
        if not self.rl.rollout.check_due(step, self.rl.total_steps, first=not self.engine_checked):
            return []
        self.engine_checked = True
        return self.val.prompt_ids[:2]

    def _prompt_texts(self, batch: Batch) -> list[str]:
        return [self.train.prompts[r][-1]["content"] for r in batch.meta["prompt_row"]]

    # ---- checkpoints ---------------------------------------------------------------------------------

    def save_checkpoint(self, step: int) -> None:
        with tempfile.TemporaryDirectory(dir=self.checkpoints.tmp_dir) as tmp:
            self.actor.call("save_checkpoint", tmp)
            if self.critic:
                self.critic.call("save_checkpoint", tmp)
            state = {"step": step, "kl_ctrl": self.kl_ctrl.state_dict(), "python_rng": random.getstate(),
                     "torch_rng": torch.get_rng_state(), "no_signal": self.no_signal.state_dict(),
                     **(self.schedule.state() if self.schedule else {})}
            torch.save(state, Path(tmp) / "trainer.pt")
            (Path(tmp) / "meta.json").write_text(json.dumps({"step": step}))
            self.checkpoints.save(step, Path(tmp))

    def resume(self) -> None:
        path = self.checkpoints.latest() if self.rl.resume_mode == "auto" else None
        if path is None:  # from step 0: an earlier attempt's checkpoints (--refresh-cache, resume_mode=disable, all
            # corrupt) go first, then its rows; tables first left its final checkpoint without them when this run
            # failed before its first save, and a rerun took that checkpoint for the finished stage
            self.checkpoints.clear()
            self.tables.truncate_after(0)
            return
        self.actor.call("load_checkpoint", str(path))
        if self.critic:
            self.critic.call("load_checkpoint", str(path))
        state = load_state(path / "trainer.pt")  # tensors and plain values only: a checkpoint cannot run code
        self.step = int(state["step"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.no_signal.load_state_dict(state.get("no_signal", {}))
        random.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        removed = self.tables.truncate_after(self.step)
        self.next_group = int(state.get("async_next_group", self.step * self.rl.train_batch_size))
        if self.engines is self.actor:  # else AsyncSchedule pushes the weights to the rollout workers
            self.actor.call("sync_weights", self.due_check_prompts(self.step))
        # a console line (and run.log's): a rerun that starts over where the user expected a resume is worth seeing
        LINES.info("rl: resumed at step %d from %s (%d partial trajectory files removed)", self.step, path, removed)

    def close(self, finished: bool = False) -> None:
        """Stop the producer and the reward pool; the workers are released even when one of those fails."""
        try:
            if self.schedule:
                self.schedule.close(finished)
            self.gen.close()
        finally:
            self._release_workers()

    def _release_workers(self) -> None:
        for group in {id(g): g for g in (self.actor, self.engines, self.critic) if g}.values():
            group.kill()
        if self.reward_model:
            self.reward_model.kill()
        if self.placement:
            self.placement.remove()
