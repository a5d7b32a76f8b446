"""The asynchronous schedules of the RL loop (`rl.async_training`): rollout workers generating ahead of the trainer.

With `ray.rollout_devices_per_node` > 0, rollout workers (stages/workers/rollout_worker.py) generate on devices of
their own and the trainer's workers hold no engine. A producer thread in the driver (`AsyncRollout`) asks them for
chunks of `generation_groups` prompts, scores each chunk and queues its groups (n samples of one prompt); the
trainer's step takes `train_batch_size` groups from the queue, trains, and pushes its weights to the rollout
workers (stages/workers/weight_transfer.py) when due. The rest of the step (logprobs, advantages, updates,
metrics, trajectories, checkpoints) is the synchronous loop's, on the same workers.

Versions: the policy after k updates is version k; step s trains version s-1. A group's version is the one its
generation started with (its oldest token's). Its staleness when trained is (s-1) - version.

    mode          staleness bound   pushes          generation
    sync          0                 every step      whole batches, each after the previous step's push
    one_step_off  1                 every step      step s+1's batch while step s trains (verl's recipe)
    fully_async   max_staleness     every K steps   chunks; with partial_rollout, a push lands between segments of
                                                    generation in flight (stages/rollout/partial.py)

`staleness_policy=wait` (the only one of sync and one_step_off): groups are taken in the order they are kept, so the
k-th kept group trains in step k // train_batch_size + 1; a chunk never asks for more groups than that step still
needs, and starts only when the engines' version is new enough for it, so no sample is ever staler than the bound
(dynamic sampling may keep fewer groups: the next chunk asks for the rest). The sync mode is then exactly the
synchronous loop on other devices (same prompts, seeds and group ids: tested equal). `drop`: chunks start whenever
the queue has room (`queue_groups`), and the trainer drops groups over the bound as it takes them
(`async/dropped_groups`).

Resume: the checkpoint records the next group to take (`next_group`); groups that were queued or in flight when the
run stopped are generated again, with the checkpoint's weights. A rollout worker that dies fails the step with its
error; one that stalls fails it after `rollout_timeout_s` without a group (or with a weight push or validation
waiting that long for its engine call or chunk in flight, or a push's own worker calls taking that long);
dynamic sampling that generates `max_num_gen_batches` steps' worth of groups without filling a step fails it as
the synchronous loop does (it used to generate on until that timeout, which then blamed the workers). Validation
pauses the producer at a chunk boundary and pushes the current weights first, so it measures the policy of the
step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from infra.rl_config import AsyncTrainingConfig
from stages.batch import Batch
from stages.rl_data import average_metrics, concat_batches, rollout_metrics, signal_metrics
from stages.rollout.base import RolloutOutput, SamplingParams
from stages.rollout.partial import generate_in_segments, versioned
from stages.workers.actor_rollout import engine_max_len

logger = logging.getLogger(__name__)

EngineFn = Callable[[list[list[int]], SamplingParams], list[RolloutOutput]]


LEAVE_TIMEOUT_S = 30.0  # the longest the end of a finished run waits for the weight group's last broadcast


class RolloutFailed(RuntimeError):
    """The rollout workers stopped producing groups (a worker died, raised, or stalled)."""


@dataclass
class Group:
    """n scored samples of one prompt, and what the step that trains it reports besides: the chunk metrics and the
    untrained groups generated since the group before it, so that every chunk and every generated group is reported
    once (a chunk whose groups dynamic sampling dropped all, and a group dropped for staleness, included)."""

    index: int  # position in the run's sequence of groups (prompt order); resume restarts from a group index
    batch: Batch  # its scored samples
    version: int  # the engines' policy version when its generation started (its oldest token's)
    metrics: list[dict[str, float]] = field(default_factory=list)  # generation and reward metrics of chunks
    untrained: list[Batch] = field(default_factory=list)  # groups generated before it that no step trains

    def absorb(self, dropped: Group) -> None:
        """Report a group dropped before this one (and what it carried) with this one."""
        self.metrics = dropped.metrics + self.metrics
        self.untrained = [*dropped.untrained, for_metrics(dropped.batch), *self.untrained]


def for_metrics(group: Batch) -> Batch:
    """What a step's signal and tool metrics read of an untrained group (its rewards and scores, group ids and
    turn counts): a long run of groups without signal stays small until a kept group carries it."""
    return Batch({k: group.tensors[k] for k in ("rewards", "scores")},
                 {k: group.meta[k] for k in ("group_id", "num_turns", "rollout_metrics")})


class AsyncRollout:
    """The producer thread, its bounded queue of groups, and the engines' policy version.

    `produce(first, count)` generates and scores groups first .. first+count-1 (calling `generate` below for every
    engine call) and returns the groups it keeps (dynamic sampling may drop some)."""

    def __init__(self, settings: AsyncTrainingConfig, batch_size: int, engine: EngineFn,
                 produce: Callable[[int, int], list[Group]], next_group: int, version: int,
                 max_gen_batches: int = 0, max_model_len: int | None = None):
        """max_gen_batches: with dynamic sampling (rl.algorithm.max_num_gen_batches), the producer fails once it
        has generated that many steps' worth of groups without keeping a whole step's (0: never). max_model_len:
        the engines' (partial rollouts do not continue a sample that fills it)."""
        fully = settings.mode == "fully_async"
        self.batch_size, self.staleness = batch_size, settings.staleness
        self.chunk = (settings.generation_groups or batch_size) if fully else batch_size
        self.capacity = max(settings.queue_groups or 2 * batch_size, self.chunk)
        self.policy = settings.staleness_policy if fully else "wait"
        self.partial_tokens = settings.partial_rollout_tokens if fully and settings.partial_rollout else None
        self.timeout_s, self.max_model_len = settings.rollout_timeout_s, max_model_len
        self._engine, self._produce = engine, produce
        self.version, self.next_group = version, next_group  # next_group: the first group not yet taken
        self._next_chunk = next_group
        self._kept = version * batch_size  # groups kept so far: each of the `version` steps trained took batch_size
        self._max_generated = max_gen_batches * batch_size
        self._generated = 0  # groups generated since the kept groups last filled a step
        self._generated_total = 0  # groups generated in all (kept or not): what a timed-out wait saw come
        self._queue: deque[Group] = deque()
        self._cond = threading.Condition()
        self._in_chunk = self._pausing = self._pushing = self._closed = False
        self._in_engine = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ---- the producer thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(self._may_start)
                    if self._closed:
                        return
                    first, count = self._next_chunk, self._chunk_size()
                    self._next_chunk, self._in_chunk = first + count, True
                try:
                    groups = self._produce(first, count)
                finally:
                    with self._cond:
                        self._in_chunk = False
                        self._cond.notify_all()
                with self._cond:
                    self._queue.extend(groups)
                    self._count(count, len(groups))
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _count(self, generated: int, kept: int) -> None:
        """Dynamic sampling's bound, as the synchronous loop's: so many groups generated without filling a step
        means the reward hardly ever varies within a group."""
        filled = (self._kept + kept) // self.batch_size > self._kept // self.batch_size
        self._kept += kept
        self._generated_total += generated
        self._generated = 0 if filled else self._generated + generated
        if self._max_generated and self._generated >= self._max_generated:
            raise RuntimeError(
                f"dynamic sampling kept {self._kept % self.batch_size}/{self.batch_size} groups of the next step after "
                f"{self._generated} generated groups ({self._max_generated // self.batch_size} steps' worth); raise "
                "rl.algorithm.max_num_gen_batches or check the reward")

    def _chunk_size(self) -> int:
        """Groups of the next chunk. `wait`: no more than the next step still needs, so that every group the chunk
        keeps trains in one known step (dynamic sampling may keep fewer: the next chunk fills the rest)."""
        if self.policy == "drop":
            return self.chunk
        return min(self.chunk, self.batch_size - self._kept % self.batch_size)

    def _may_start(self) -> bool:
        if self._closed:
            return True
        if self._pausing or len(self._queue) + self._chunk_size() > self.capacity:
            return False
        return self.policy == "drop" or self.version >= self.required_version()

    def required_version(self) -> int:
        """`wait`: the oldest engine version the next chunk may use. Groups are taken in the order they are kept, so
        the next kept group trains in step kept // batch_size + 1, on version kept // batch_size."""
        return self._kept // self.batch_size - self.staleness

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[RolloutOutput]:
        """The engines' generate, each output's tokens tagged with their policy version; in segments with partial
        rollouts (a push lands between them)."""
        if self.partial_tokens:
            return generate_in_segments(self._call, prompt_ids, params, self.partial_tokens, self.max_model_len)
        outputs, version = self._call(prompt_ids, params)
        return versioned(outputs, version)

    def _call(self, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[list[RolloutOutput], int]:
        with self._cond:
            self._cond.wait_for(lambda: not self._pushing or self._closed)
            if self._closed:
                raise RolloutFailed("the asynchronous rollout was closed")
            self._in_engine += 1
            version = self.version
        try:
            return self._engine(prompt_ids, params), version
        finally:
            with self._cond:
                self._in_engine -= 1
                self._cond.notify_all()

    # ---- the trainer's side ---------------------------------------------------------------------------------

    def take(self, num_groups: int, trained_version: int) -> tuple[list[Group], dict[str, float]]:
        """The next `num_groups` groups for the step that trains `trained_version` (waiting for them), dropping those
        over the staleness bound (policy drop). RolloutFailed when the producer failed or nothing came in time."""
        start = time.perf_counter()
        taken, dropped, carried = [], 0, None
        with self._cond:
            queued = len(self._queue)
            while len(taken) < num_groups:  # rollout_timeout_s bounds the wait for each group
                generated = self._generated_total
                ready = self._cond.wait_for(lambda: self._queue or self._error is not None, timeout=self.timeout_s)
                self._raise_failure(ready, self._generated_total - generated)
                group = self._queue.popleft()
                self.next_group = group.index + 1
                self._cond.notify_all()  # room in the queue
                if carried is not None:
                    group.absorb(carried)
                    carried = None
                if trained_version - group.version > self.staleness:
                    dropped, carried = dropped + 1, group  # reported with the next group taken
                    continue
                taken.append(group)
        return taken, {"async/dropped_groups": float(dropped), "async/queue_groups": float(queued),
                       "async/wait_s": time.perf_counter() - start}

    def _raise_failure(self, ready: bool, generated: int = 0) -> None:
        """Raise the producer's error, or say why nothing came in time: `generated` groups came and dynamic sampling
        kept none (a reward without spread, with no max_num_gen_batches limit), or a worker stalled."""
        if self._error is not None:
            raise RolloutFailed(f"the rollout workers failed while generating ({type(self._error).__name__}: "
                                f"{self._error}); the run stops here, and a rerun resumes from the last "
                                "checkpoint") from self._error
        if not ready and generated:
            raise RolloutFailed(
                f"no group was kept in {self.timeout_s:g} s (rl.async_training.rollout_timeout_s): the rollout workers "
                f"generated {generated} groups meanwhile, and dynamic sampling dropped them all (the same reward for "
                "every sample of a group); check the reward, or set rl.algorithm.max_num_gen_batches to stop sooner")
        if not ready:
            raise RolloutFailed(
                f"no scored group came from the rollout workers in {self.timeout_s:g} s "
                "(rl.async_training.rollout_timeout_s): a rollout worker is stalled, or one chunk takes longer to "
                "generate and score (then raise the timeout or lower rl.async_training.generation_groups)")

    def push(self, version: int, send: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Run `send` (the weight transfer) while no engine call is running, then mark the engines `version`. A
        chunk in flight waits at its next engine call (partial rollouts: between segments) and goes on after."""
        start = time.perf_counter()
        with self._cond:
            self._pushing = True
        try:
            with self._cond:
                if not self._cond.wait_for(lambda: self._in_engine == 0, timeout=self.timeout_s):
                    raise RolloutFailed(
                        f"a weight push waited {self.timeout_s:g} s (rl.async_training.rollout_timeout_s) for the "
                        "rollout workers' engine call in flight: a rollout worker is stalled, or one engine call "
                        "takes longer (then raise the timeout, or lower rl.async_training.generation_groups)")
            waited = time.perf_counter() - start
            metrics = send()
            with self._cond:
                self.version = version
        finally:
            with self._cond:
                self._pushing = False
                self._cond.notify_all()
        return {**metrics, "async/push_wait_s": waited}

    @contextmanager
    def paused(self):
        """No chunk runs inside (the one in flight finishes first): the engines and the reward pool are free."""
        with self._cond:
            self._pausing = True
        try:
            with self._cond:
                ready = self._cond.wait_for(lambda: not self._in_chunk or self._error is not None,
                                            timeout=self.timeout_s)
                self._raise_failure(ready)
            yield
        finally:
            with self._cond:
                self._pausing = False
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


class AsyncSchedule:
    """The RL trainer's side of the asynchronous modes: what a step takes from the producer, weight pushes and
    their check, validation on the current policy, the checkpointed position. `trainer` is stages.rl.RLTrainer
    with rollout workers of their own (`trainer.engines`)."""

    def __init__(self, trainer, next_group: int, version: int):
        self.trainer, settings = trainer, trainer.rl.async_training
        self.push_every = settings.trigger_parameter_sync_step if settings.mode == "fully_async" else 1
        self.meta = trainer.actor.call_one("weight_meta")
        # what the producer has not yet attached to a kept group: groups dynamic sampling dropped, chunks' metrics
        self._untrained: list[Batch] = []
        self._chunk_metrics: list[dict[str, float]] = []
        alg = trainer.rl.algorithm
        self.rollout = AsyncRollout(settings, trainer.rl.train_batch_size, trainer.gen.engine_generate, self.produce,
                                    next_group, version, alg.max_num_gen_batches if alg.filter_groups else 0,
                                    engine_max_len(trainer.cfg))
        if version > 0:  # resumed: the engines still hold the initial weights
            self.push(version)
        trainer.gen.versioned_generate = self.rollout.generate  # before the producer's first generate
        self.rollout.start()
        logger.info("rl: %s rollout on %d rollout workers: staleness <= %d (%s), weights pushed every %d steps%s%s",
                    settings.mode, trainer.engines.world_size, self.rollout.staleness, self.rollout.policy,
                    self.push_every, f", partial rollouts of {self.rollout.partial_tokens} tokens"
                    if self.rollout.partial_tokens else "", self._correction_hint(alg.rollout_correction))

    def _correction_hint(self, correction) -> str:
        """A hint when stale samples train uncorrected (they learned worse in bench/results/
        2026-11-27-async-staleness.md)."""
        if self.rollout.staleness == 0 or correction.rollout_is or correction.bypass_mode:
            return ""
        return ("; no rollout correction: rl.algorithm.rollout_correction.rollout_is=token weighs the stale samples "
                "by how far the trained policy has moved from the one that generated them")

    def produce(self, first: int, count: int) -> list[Group]:
        """Groups first .. first+count-1, generated and scored; their prompts are the synchronous loop's (group g is
        prompt g % train_batch_size of step g // train_batch_size + 1), and so are the seed and group ids of a chunk
        that is one whole step's batch."""
        t, size = self.trainer, self.trainer.rl.train_batch_size
        orders = {s: t.gen.sampler.indices(s) for s in {g // size + 1 for g in range(first, first + count)}}
        indices = [orders[g // size + 1][g % size] for g in range(first, first + count)]
        step, offset = first // size + 1, first % size
        start = time.perf_counter()
        # timed as a whole (async/generate_s), not by a step's timer
        batch, metrics = t.gen.generate(indices, f"{step}-{offset}", t.gen.batch_seed(step, offset),
                                        lambda name: nullcontext())
        generated = time.perf_counter() - start
        kept = set((t.gen.varied_groups(batch) if t.rl.algorithm.filter_groups else batch).meta["group_id"])
        groups = self._groups(batch, kept, first)
        self._chunk_metrics.append({**metrics, "async/generate_s": generated, "async/chunks": 1.0,
                                    "async/filtered_groups": float(count - len(groups))})
        if groups:
            groups[0].metrics, self._chunk_metrics = self._chunk_metrics, []
        return groups

    def _groups(self, batch: Batch, kept: set[str], first: int) -> list[Group]:
        """The chunk's kept groups, each carrying the dropped ones generated since the kept group before it."""
        rows: dict[str, list[int]] = {}
        for i, group_id in enumerate(batch.meta["group_id"]):
            rows.setdefault(group_id, []).append(i)
        groups = []
        for group_id, members in rows.items():
            group = batch.select(members)
            if group_id not in kept:
                self._untrained.append(for_metrics(group))
                continue
            versions = [v for v in group.meta["policy_version"] if v is not None]
            groups.append(Group(first + int(group_id.rsplit("-", 1)[1]), group,
                                min(versions, default=self.rollout.version), untrained=self._untrained))
            self._untrained = []
        return groups

    def next_batch(self, step: int) -> tuple[Batch, dict[str, float]]:
        """The step's train_batch_size groups as one batch, with the metrics of the chunks they came from and how
        stale they are."""
        t = self.trainer
        groups, metrics = self.rollout.take(t.rl.train_batch_size, step - 1)
        batches = [g.batch for g in groups]
        batch = concat_batches(batches, t.tokenizer.pad_token_id) if len(batches) > 1 else batches[0]
        metrics.update(average_metrics([m for g in groups for m in g.metrics]))
        generated = [b for g in groups for b in (*g.untrained, g.batch)]  # as the synchronous loop's, unfiltered
        staleness = torch.tensor([float(step - 1 - v) for v in batch.meta["policy_version"] if v is not None])
        spans = [len({v for v in vs if v >= 0}) > 1 for vs in batch.meta["token_versions"]]
        metrics.update({"async/staleness/mean": float(staleness.mean()) if len(staleness) else 0.0,
                        "async/staleness/max": float(staleness.max()) if len(staleness) else 0.0,
                        "async/partial_frac": sum(spans) / max(len(spans), 1),
                        "async/rollout_version": float(self.rollout.version),
                        **signal_metrics(generated), **rollout_metrics(generated)})
        return batch, metrics

    def after_update(self, step: int) -> dict[str, float]:
        """Push the weights of version `step` when due (every push_every steps, and after the last step)."""
        if step % self.push_every and step < self.trainer.rl.total_steps:
            return {}
        return self.push(step)

    def push(self, version: int) -> dict[str, float]:
        return self.rollout.push(version, lambda: self._send(version))

    def _send(self, version: int) -> dict[str, float]:
        """Trainer ranks gather and broadcast, rollout workers receive into their engines; then the check. Each
        wait on the workers is bounded by rl.async_training.rollout_timeout_s: a stalled one fails the run."""
        t, timeout = self.trainer, self.rollout.timeout_s
        refs = [h.send_weights.remote() for h in t.actor.handles]
        refs += [h.receive_weights.remote(self.meta) for h in t.engines.handles]
        try:
            results = t.actor.get_all(refs, timeout)
            metrics = {**results[0], "timing_s/receive": max(results[len(t.actor.handles):])}
            metrics.update(self._check(version, timeout))
            return {**metrics, **t.engines.call_within(timeout, "memory_metrics")[0]}  # the rollout workers'
        except ray_errors() as exc:
            raise RolloutFailed(f"a rollout worker died during a weight push ({exc}); the run stops here, and a "
                                "rerun resumes from the last checkpoint") from exc
        except TimeoutError as exc:
            raise RolloutFailed(f"a weight push of version {version} stalled: {exc} (rl.async_training."
                                "rollout_timeout_s); a worker is stuck, and a rerun resumes from the last "
                                "checkpoint") from exc

    def _check(self, version: int, timeout_s: float) -> dict[str, float]:
        """Every engine generates greedy tokens on the check prompts; the trainer re-scores them (as the colocated
        sync does) when due after version `version`: StaleEngineError above rl.rollout.logprob_check_tol."""
        t = self.trainer
        prompts = t.due_check_prompts(version)
        tokens = min(t.rl.rollout.logprob_check_tokens, t.cfg.data.max_response_length)
        if not tokens or not prompts:
            return {}
        params = SamplingParams(n=1, temperature=0.0, max_tokens=tokens)
        per_engine = t.engines.call_within(timeout_s, "generate", prompts, params)
        per_engine = per_engine[:: t.rl.rollout.tensor_model_parallel_size]
        diff = t.actor.call_one("engine_diff", prompts, [o for outs in per_engine for o in outs])
        return {"rollout/logprob_diff_max": diff}

    @contextmanager
    def current_policy(self, step: int):
        """The producer paused with the engines holding version `step` (pushed now when behind): validation."""
        with self.rollout.paused():
            if self.rollout.version < step:
                self.push(step)
            yield

    def state(self) -> dict[str, int]:
        return {"async_next_group": self.rollout.next_group}

    def close(self, finished: bool = False) -> None:
        """Stop the producer; after a run that `finished`, every end of the weight group also leaves it (the
        workers are killed next: a trainer leaving first made the rollout workers' NCCL watchdog report its store
        gone). After a failure the group may be mid-push, so it is left to the kill."""
        self.rollout.close()
        if not finished:
            return
        t = self.trainer
        try:
            t.actor.get_all([h.close_weight_group.remote() for h in t.actor.handles + t.engines.handles],
                            min(LEAVE_TIMEOUT_S, self.rollout.timeout_s))
            logger.info("rl: the trainer and the rollout workers left the weight group")
        except (TimeoutError, *ray_errors()) as exc:
            logger.warning("rl: the weight group was not left cleanly (%s); the workers are stopped anyway", exc)


def ray_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return (RayActorError, ActorDiedError, ActorUnavailableError)
