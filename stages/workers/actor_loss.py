"""The actor's micro-batch loss: the policy loss (+ KL loss, - entropy bonus), for TrainEngine (train_engine.py).

All the math is in stages/core; this file only feeds it.
"""

from __future__ import annotations

from infra.config import Config
from stages.batch import Batch
from stages.core import POLICY_LOSSES, agg_loss, kl_loss
from stages.workers.train_engine import local_scale

LOSS_INPUTS = ("old_logprobs", "ref_logprobs", "advantages", "response_mask")  # besides the model's inputs


def actor_loss(model, micro: Batch, denominators: dict, cfg: Config, to_device):
    """Policy loss (+ KL loss, - entropy bonus) of one micro-batch, scaled by the global denominators; its
    metrics as device scalars (see MetricMeans)."""
    actor = cfg.rl.actor
    t = to_device({k: micro.tensors[k] for k in LOSS_INPUTS if k in micro.tensors})
    bonus = actor.entropy_coeff > 0  # the entropy metric itself comes from the old-logprob pass (verl's)
    logprobs, entropy = model(**to_device(micro), temperature=cfg.rl.rollout.temperature, with_entropy=bonus)
    mask = t["response_mask"]
    scale = {**denominators, "max_response_length": cfg.data.max_response_length}
    pg_loss, pg_metrics = POLICY_LOSSES.get(actor.policy_loss.name)(
        t["old_logprobs"], logprobs, t["advantages"], mask, actor.loss_agg_mode,
        clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c, **scale, **actor.policy_loss.params(),
    )
    loss = pg_loss
    metrics = dict(pg_metrics)
    if bonus:
        entropy_loss = agg_loss(entropy, mask, actor.loss_agg_mode, **scale)
        loss = loss - actor.entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = entropy_loss.detach() * local_scale(denominators, micro.response_mask)
    if actor.use_kl_loss:
        kl, kl_metrics = kl_loss(logprobs, t["ref_logprobs"], mask, actor.kl_loss_type, actor.loss_agg_mode, **scale)
        loss = loss + actor.kl_loss_coef * kl
        metrics["actor/kl_loss"] = kl.detach() * local_scale(denominators, micro.response_mask)
        metrics["actor/kl_coef"] = actor.kl_loss_coef
    metrics["actor/pg_loss"] = pg_loss.detach() * local_scale(denominators, micro.response_mask)
    return loss, metrics
