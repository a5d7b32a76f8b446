"""Conversions of the keys of verl's asynchronous recipes (`recipe/one_step_off_policy`, `recipe/fully_async_policy`:
`rollout.*`, `async_training.*`) to ours, for the table in infra/verl_keys.py; as in infra/verl_convert.py, each takes
the value and `Given` and returns our overrides or raises ValueError with the reason.

Rollout GPUs of their own make the schedule one_step_off, or fully_async with any `async_training.*` key; verl's
staleness and test frequency count weight syncs, ours trainer steps.
"""

from __future__ import annotations

import math
from typing import Any

from infra.verl_convert import Convert, Given, Overrides, fully_async, total_steps, train_batch


def rollout_total_epochs(value: Any, given: Given) -> Overrides:
    """verl's asynchronous recipes: the rollouter's epochs over the prompts, as trainer.total_epochs."""
    if given.get("trainer.total_training_steps", None) is not None or given.is_given("rollout.total_rollout_steps"):
        return {}
    return {"rl.total_steps": total_steps(given, "rollout.total_epochs")}


def total_rollout_steps(value: Any, given: Given) -> Overrides:
    """verl's fully async recipe: prompts generated over the run -> steps of train_batch prompts."""
    batch = train_batch(given)
    if value < batch:
        raise ValueError(f"fewer prompts than one step takes ({batch}: async_training.require_batches x "
                         "ppo_mini_batch_size): raise it")
    return {"rl.total_steps": value // batch}


def rollout_gpus(value: Any, given: Given) -> Overrides:
    """Rollout GPUs of their own: verl's one_step_off_policy recipe, or fully_async_policy with its keys."""
    if value < 1:
        raise ValueError("at least 1 (0 GPUs of their own: drop the key, the workers are then colocated)")
    return {"ray.rollout_devices_per_node": value,
            "rl.async_training.mode": "fully_async" if fully_async(given) else "one_step_off"}


def async_setting(ours: str) -> Convert:
    """A fully async recipe key: sets `ours` (if any), the mode and the step size it implies (train_batch)."""
    def apply(value: Any, given: Given) -> Overrides:
        out = {"rl.async_training.mode": "fully_async", "rl.train_batch_size": train_batch(given)}
        return out if not ours else {**out, ours: value}

    return apply


def staleness(threshold: Any, given: Given) -> Overrides:
    """verl counts staleness in weight syncs (a sample may come from ceil(threshold) syncs back); here in trainer
    steps: with a push every T steps a sample trains up to T - 1 steps after its window began, plus T per sync."""
    if threshold < 0:
        raise ValueError("a share of stale samples >= 0")
    every = sync_every(given)
    return async_setting("rl.async_training.max_staleness")(every - 1 + math.ceil(threshold) * every, given)


def sync_every(given: Given) -> int:
    return given.get("async_training.trigger_parameter_sync_step",
                     given.base.rl.async_training.trigger_parameter_sync_step)


def hybrid_engine(value: Any, given: Given) -> Overrides:
    if value is False and not given.is_given("rollout.n_gpus_per_node"):
        raise ValueError("a rollout of its own needs its GPUs: give rollout.n_gpus_per_node (verl's asynchronous "
                         "recipes), else actor, reference and rollout share the workers")
    return {}


def rollout_bypass(_value: Any, given: Given) -> Overrides:
    """use_rollout_log_probs / compute_prox_log_prob: the rollout's logprobs are the old policy (bypass) when the
    first is on and the second (the trainer recomputing them) is off."""
    bypass = bool(given.get("async_training.use_rollout_log_probs", False)) and not given.get(
        "async_training.compute_prox_log_prob", False)
    return async_setting("rl.algorithm.rollout_correction.bypass_mode")(bypass, given)


def rollout_test_freq(value: Any, given: Given) -> Overrides:
    """verl: validate every N weight syncs; here every N x trigger_parameter_sync_step steps."""
    return {"rl.test_freq": max(0, value) * sync_every(given)}
