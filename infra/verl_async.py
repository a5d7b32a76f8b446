"""Conversions of the keys of verl's asynchronous recipes (`recipe/one_step_off_policy`, `recipe/fully_async_policy`:
`rollout.*`, `async_training.*`) to ours, for the table in infra/verl_keys.py; as in infra/verl_convert.py, each takes
the value and `Given` and returns our overrides or raises ValueError with the reason.

Rollout GPUs of their own make the schedule one_step_off, or fully_async with any `async_training.*` key; verl's
staleness and test frequency count weight syncs, ours trainer steps.
"""

from __future__ import annotations

import math
from typing import Any

from infra.verl_convert import (
    AfterDataPrep,
    Convert,
    Given,
    Overrides,
    epoch_steps,
    fully_async,
    total_epochs,
    train_batch,
)


def rollout_total_epochs(value: Any, given: Given) -> Overrides:
    """verl's asynchronous recipes: the rollouter's passes over the prompts, as trainer.total_epochs."""
    if given.get("trainer.total_training_steps", None) is not None:
        return {}
    return rollout_steps(given)


def total_rollout_steps(value: Any, given: Given) -> Overrides:
    """verl's fully async recipe: prompts generated over the run -> steps of train_batch prompts (null: no bound)."""
    batch = train_batch(given)
    if value is not None and value < batch:
        raise ValueError(f"fewer prompts than one step takes ({batch}: async_training.require_batches x "
                         "ppo_mini_batch_size): raise it")
    return rollout_steps(given)


def trainer_total_epochs(value: Any, given: Given) -> Overrides:
    """trainer.total_epochs; in verl's fully async recipe one more bound on the rollouter's prompts."""
    if fully_async(given) and given.get("trainer.total_training_steps", None) is None:
        return rollout_steps(given)
    return total_epochs(value, given)


def rollout_steps(given: Given) -> Overrides:
    """verl's fully async rollouter generates min(rollout.total_rollout_steps, rows x trainer.total_epochs) prompts, in
    at most rollout.total_epochs passes over the rows (fully_async_rollouter.py): here the fewest steps that the
    bounds given allow, an epoch being rows // train_batch steps. Bounds not given are not verl's defaults (100
    prompts, 10 and 30 epochs) but absent: {} when none is given."""
    prompts = given.get("rollout.total_rollout_steps", None)
    steps = [] if prompts is None else [prompts // train_batch(given)]
    epoch_keys = ["rollout.total_epochs"] + (["trainer.total_epochs"] if fully_async(given) else [])
    steps += [epoch_steps(given, key) for key in epoch_keys if given.is_given(key)]
    known = [s for s in steps if not isinstance(s, AfterDataPrep)]
    bounds = ([min(known)] if known else []) + [s for s in steps if isinstance(s, AfterDataPrep)]
    if not bounds:
        return {}
    if len(bounds) == 1:
        return {"rl.total_steps": bounds[0]}
    return {"rl.total_steps": AfterDataPrep(f"min({', '.join(map(str, bounds))})")}


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
    first is on and the second (the trainer recomputing them) is off; the one not given has verl's default (True,
    False: fully_async_ppo_trainer.yaml)."""
    bypass = bool(given.get("async_training.use_rollout_log_probs", True)) and not given.get(
        "async_training.compute_prox_log_prob", False)
    return async_setting("rl.algorithm.rollout_correction.bypass_mode")(bypass, given)


def rollout_test_freq(value: Any, given: Given) -> Overrides:
    """verl: validate every N weight syncs; here every N x trigger_parameter_sync_step steps."""
    return {"rl.test_freq": max(0, value) * sync_every(given)}
