"""Conversions of verl's values to ours, for the table in infra/verl_keys.py: each takes the value and what else
was given (`Given`) and returns our overrides, `{dotted key: value}` ({} : nothing to set), or raises ValueError
with the reason a value cannot run here.

Where verl's behaviour depends on other keys (a parameter read only by some estimators, LoRA fields read only with
lora_rank > 0, warmup given as a share of the total steps), the conversion reads them as verl does. Units: verl's
batch sizes are prompts (`data.train_batch_size`, `ppo_mini_batch_size`, as ours) and samples per GPU
(`*_micro_batch_size_per_gpu`, as our `micro_batch_size`); steps are training steps in both.

Here: `Given` and what several conversions read (batch sizes, total steps), and the keys of ppo_trainer.yaml and
the DAPO recipe; those of verl's asynchronous recipes are in infra/verl_async.py, data.train_files / val_files in
infra/verl_files.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

from infra.algorithms import AdvEstimator, PolicyLoss, variant_names
from infra.config import Config

MISSING = object()
Overrides = dict[str, Any]
Convert = Callable[[Any, "Given"], Overrides]


class AfterDataPrep(str):
    """A value known only once data prep has counted the training rows; the text says how it is computed."""


@dataclass
class Given:
    """What a key's conversion may read besides its own value."""

    verl: dict[str, Any]  # every verl key given -> its value
    base: Config  # the recipe and native overrides, before verl's
    rows: int | None = None  # training rows; None until data prep has run

    def get(self, key: str, default: Any = MISSING) -> Any:
        return self.verl.get(key, default)

    def is_given(self, key: str) -> bool:
        return key in self.verl


# --------------------------------------------------------------------------------------------------
# What several conversions read


def train_batch(given: Given) -> int:
    """Prompts per step; in verl's fully async recipe (async_training.* given) a step here is one of its local
    updates, require_batches mini-batches (its data.train_batch_size is not read there)."""
    if fully_async(given):
        return given.get("async_training.require_batches", 1) * mini_batch(given)
    return given.get("data.train_batch_size", given.base.rl.train_batch_size)


def fully_async(given: Given) -> bool:
    """verl's fully_async_policy recipe: its async_training.* keys."""
    return any(key.startswith("async_training.") for key in given.verl)


def mini_batch(given: Given) -> int:
    return given.get("actor_rollout_ref.actor.ppo_mini_batch_size", given.base.rl.actor.ppo_mini_batch_size)


def model_path(given: Given) -> str:
    return given.get("actor_rollout_ref.model.path", given.base.model.path)


def ckpt_to_keep(given: Given) -> int:
    return given.get("trainer.max_actor_ckpt_to_keep", given.base.rl.max_ckpt_to_keep)


def total_steps(given: Given, epochs_key: str = "trainer.total_epochs") -> int | AfterDataPrep:
    """verl: total_training_steps if set, else total_epochs x (training rows // train_batch_size)."""
    steps = given.get("trainer.total_training_steps", None)
    if steps is not None:
        return steps
    if not given.is_given(epochs_key):
        return given.base.rl.total_steps
    return epoch_steps(given, epochs_key)


def epoch_steps(given: Given, epochs_key: str) -> int | AfterDataPrep:
    """`epochs_key`'s epochs x (training rows // train_batch_size): steps of whole batches, as verl drops a last
    partial batch."""
    epochs, batch = given.get(epochs_key), train_batch(given)
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise ValueError(f"a whole number of epochs >= 1, not {epochs!r}")
    if given.rows is None:
        return AfterDataPrep(f"{epochs} x (training rows // {batch})")
    if given.rows < batch:
        raise ValueError(f"{given.rows} training rows make no full batch of data.train_batch_size={batch} (verl, "
                         "like this project, drops a last partial batch): lower data.train_batch_size")
    return epochs * (given.rows // batch)


def total_epochs(value: Any, given: Given) -> Overrides:
    if given.get("trainer.total_training_steps", None) is not None:
        return {}
    return {"rl.total_steps": total_steps(given)}


def gen_batch_size(value: Any, given: Given) -> Overrides:
    """DAPO recipe: only data.train_batch_size; fully async recipe (streaming, 1): our chunks instead."""
    if fully_async(given):
        return {}
    return equal_to("data.train_batch_size", train_batch, "each generation round draws data.train_batch_size "
                    "prompts here")(value, given)


def train_batch_size(value: Any, given: Given) -> Overrides:
    return {} if fully_async(given) else {"rl.train_batch_size": value}


def total_training_steps(value: Any, _given: Given) -> Overrides:
    return {} if value is None else {"rl.total_steps": value}


def warmup_ratio(role: str) -> Convert:
    def apply(ratio: Any, given: Given) -> Overrides:
        steps = given.get(f"{_OPTIM[role]}.lr_warmup_steps", None)
        if steps is not None and steps >= 0:
            return {}  # verl: lr_warmup_steps >= 0 wins over the ratio
        total = total_steps(given)
        if isinstance(total, AfterDataPrep):
            return {f"rl.{role}.optim.warmup_steps": AfterDataPrep(f"int({ratio} x rl.total_steps)")}
        return {f"rl.{role}.optim.warmup_steps": int(ratio * total)}

    return apply


def warmup_steps(role: str) -> Convert:
    return lambda steps, _given: {} if steps is None or steps < 0 else {f"rl.{role}.optim.warmup_steps": steps}


_OPTIM = {"actor": "actor_rollout_ref.actor.optim", "critic": "critic.optim"}


def _variant_fields(union: Any, name: str) -> set[str]:
    members = get_args(get_args(union)[0])
    return next((set(m.model_fields) for m in members if m.model_fields["name"].default == name), set())


def _estimator(given: Given) -> str:
    name = given.get("algorithm.adv_estimator", given.base.rl.algorithm.adv_estimator.name)
    return _VECTORIZED.get(name, name)


def _policy_loss(given: Given) -> str:
    return given.get("actor_rollout_ref.actor.policy_loss.loss_mode", given.base.rl.actor.policy_loss.name)


_VECTORIZED = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}  # verl's faster code for the same math


NOT_VERL = {"online_dpo"}  # ours only: set it with rl.algorithm.adv_estimator, not through verl's keys


def adv_estimator(name: Any, _given: Given) -> Overrides:
    ours = _VECTORIZED.get(name, name)
    if ours in NOT_VERL:
        raise ValueError(f"{name!r} is not one of verl's estimators; it is this project's: set "
                         f"rl.algorithm.adv_estimator={name} before --verl")
    if ours not in variant_names(AdvEstimator):
        raise ValueError(f"{name!r} is not implemented here; estimators: {', '.join(variant_names(AdvEstimator))}")
    return {"rl.algorithm.adv_estimator": ours}


def estimator_param(param: str) -> Convert:
    def apply(value: Any, given: Given) -> Overrides:
        if param not in _variant_fields(AdvEstimator, _estimator(given)):
            return {}  # verl reads it only in estimators that have it
        return {f"rl.algorithm.adv_estimator.{param}": value}

    return apply


def loss_mode(name: Any, given: Given) -> Overrides:
    if name not in variant_names(PolicyLoss):
        raise ValueError(f"{name!r} is not implemented here; policy losses: {', '.join(variant_names(PolicyLoss))}")
    out = {"rl.actor.policy_loss": name}
    if name == "gspo" and not given.is_given("actor_rollout_ref.actor.loss_agg_mode"):
        # verl's gspo aggregates its policy term with seq-mean-token-mean whatever loss_agg_mode says
        out["rl.actor.loss_agg_mode"] = "seq-mean-token-mean"
    return out


def loss_param(param: str) -> Convert:
    def apply(value: Any, given: Given) -> Overrides:
        if param not in _variant_fields(PolicyLoss, _policy_loss(given)):
            return {}
        return {f"rl.actor.policy_loss.{param}": value}

    return apply


def clip_ratio(value: Any, given: Given) -> Overrides:
    """verl reads clip_ratio only where clip_ratio_low/high are null (both default to 0.2)."""
    sides = [s for s in ("clip_ratio_low", "clip_ratio_high") if given.get(f"actor_rollout_ref.actor.{s}", 0) is None]
    return {f"rl.actor.{side}": value for side in sides}


def clip_side(side: str) -> Convert:
    def apply(value: Any, given: Given) -> Overrides:
        if value is None:  # verl: fall back to clip_ratio
            value = given.get("actor_rollout_ref.actor.clip_ratio", 0.2)
        return {f"rl.actor.{side}": value}

    return apply


def kl_name(ours: str) -> Convert:
    def apply(name: Any, _given: Given) -> Overrides:
        if name == "full":
            raise ValueError("'full' (the KL over the whole vocabulary) is not implemented here; k1/kl, k2/mse, "
                             "k3/low_var_kl, abs and their '+' forms are")
        return {ours: name}

    return apply


def _lora_on(given: Given) -> bool:
    rank = given.get("actor_rollout_ref.model.lora_rank")
    return given.base.model.lora is not None if rank is MISSING else bool(rank)


def lora_rank(rank: Any, _given: Given) -> Overrides:
    return {"model.lora": None} if rank == 0 else {"model.lora.rank": rank}


def lora_field(ours: str) -> Convert:
    return lambda value, given: {ours: value} if _lora_on(given) else {}


def _num_workers(given: Given) -> int:
    ray = given.base.ray
    return given.get("trainer.n_gpus_per_node", ray.num_devices_per_node) * given.get("trainer.nnodes", ray.num_nodes)


def global_micro_batch(value: Any, given: Given) -> Overrides:
    workers = _num_workers(given)
    if value % workers:
        raise ValueError(f"{value} is not divisible by the {workers} GPUs (n_gpus_per_node x nnodes)")
    return {"rl.actor.micro_batch_size": value // workers}


_BACKENDS = {"console": "console", "wandb": "wandb", "file": "jsonl"}


def loggers(value: Any, _given: Given) -> Overrides:
    names = [value] if isinstance(value, str) else list(value)
    unknown = [n for n in names if n not in _BACKENDS]
    if unknown:
        raise ValueError(f"{', '.join(map(str, unknown))}: not here; loggers: console, wandb, file (our jsonl)")
    return {"tracking.backends": list(dict.fromkeys(_BACKENDS[n] for n in names))}


def engine(name: Any, _given: Given) -> Overrides:
    if name not in ("vllm", "hf"):
        raise ValueError(f"{name!r} is not an engine here; vllm, hf (or our cuda engine: rl.rollout.engine=cuda)")
    return {"rl.rollout.engine": name}


def freq(ours: str) -> Convert:
    return lambda value, _given: {ours: max(0, value)}


def resume_mode(mode: Any, _given: Given) -> Overrides:
    if mode == "resume_path":
        raise ValueError("resume_path: here a run resumes from the newest checkpoint of the same configuration "
                         "(auto); picking a checkpoint by path is not supported")
    return {"rl.resume_mode": mode}


def max_samples(ours: str) -> Convert:
    return lambda value, _given: {ours: None if value is None or value < 0 else value}


def equal_to(what: str, ours: Callable[[Given], Any], reason: str) -> Convert:
    def apply(value: Any, given: Given) -> Overrides:
        expected = ours(given)
        if value != expected:
            raise ValueError(f"{value!r} differs from {what} ({expected!r}): {reason}")
        return {}

    return apply


def critic_enable(value: Any, given: Given) -> Overrides:
    gae = _estimator(given) == "gae"
    if value is not None and value != gae:
        raise ValueError(f"the critic runs exactly when the estimator is gae here (it is {_estimator(given)!r})")
    return {}


def reward_model(value: Any, given: Given) -> Overrides:
    if not value:
        return {"rl.reward.reward_model_path": None}
    path = given.get("reward_model.model.path", None)
    if path is None:
        raise ValueError("give reward_model.model.path (the reward model's folder or hub id)")
    return {"rl.reward.reward_model_path": path}


def reward_model_path(path: Any, given: Given) -> Overrides:
    return {"rl.reward.reward_model_path": path} if given.get("reward_model.enable", False) else {}


def overlong_enable(value: Any, given: Given) -> Overrides:
    length = given.get("reward_model.overlong_buffer.len", 0)
    if value and not length:
        raise ValueError("give reward_model.overlong_buffer.len > 0 (the buffer's tokens)")
    return {"rl.reward.overlong_buffer": length if value else 0}


def overlong_len(value: Any, given: Given) -> Overrides:
    return {"rl.reward.overlong_buffer": value} if given.get("reward_model.overlong_buffer.enable", False) else {}


def val_do_sample(value: Any, _given: Given) -> Overrides:
    return {} if value else {"rl.rollout.val_temperature": 0.0}


def val_temperature(value: Any, given: Given) -> Overrides:
    if given.get("actor_rollout_ref.rollout.val_kwargs.do_sample", True) is False:
        return {}  # verl: greedy whatever the temperature
    return {"rl.rollout.val_temperature": value}


def turn_limit(ours: str) -> Convert:
    def apply(value: Any, _given: Given) -> Overrides:
        if value is None:
            raise ValueError(f"null (no limit) is not supported: give a number ({ours})")
        return {ours: value}

    return apply


def run_name(value: Any, _given: Given) -> Overrides:
    return {"run.name": str(value)}


def critic_warmup(value: Any, _given: Given) -> Overrides:
    return {"rl.critic.warmup_steps_before_actor": max(0, value - 1)}


def truncation(value: Any, _given: Given) -> Overrides:
    if value == "middle":
        raise ValueError("'middle' is not supported: error, left or right")
    return {"data.truncation": value}


def seed(value: Any, _given: Given) -> Overrides:
    return {} if value is None else {"run.seed": value}
