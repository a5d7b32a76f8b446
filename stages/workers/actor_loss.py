"""The actor's micro-batch loss: the policy loss, or online DPO's pair loss (+ KL loss, - entropy bonus), for
TrainEngine (train_engine.py).

All the math is in stages/core; this file only feeds it. A pairwise estimator (online DPO) trains on a pair batch
(rows 2p, 2p + 1: pair p's chosen and rejected; see stages/core/dpo.py), so its micro-batches hold whole pairs.
"""

from __future__ import annotations

from infra.config import Config
from stages.batch import Batch
from stages.core import POLICY_LOSSES, agg_loss, dpo_loss, kl_loss
from stages.core.rollout_correction import rollout_correction
from stages.rl_correction import weighted_advantages
from stages.workers.train_engine import local_scale

LOSS_INPUTS = ("old_logprobs", "ref_logprobs", "advantages", "response_mask",  # besides the model's inputs
               "rollout_is_weights")


def actor_loss(model, micro: Batch, denominators: dict, cfg: Config, to_device):
    """Policy loss or DPO loss (+ KL loss, - entropy bonus) of one micro-batch, scaled by the global denominators;
    its metrics as device scalars (see MetricMeans)."""
    actor = cfg.rl.actor
    t = to_device({k: micro.tensors[k] for k in LOSS_INPUTS if k in micro.tensors})
    bonus = actor.entropy_coeff > 0  # the entropy metric itself comes from the old-logprob pass (verl's)
    logprobs, entropy = model(**to_device(micro), temperature=cfg.rl.rollout.temperature, with_entropy=bonus)
    mask = t["response_mask"]
    scale = {**denominators, "max_response_length": cfg.data.max_response_length}
    if cfg.rl.algorithm.adv_estimator.pairwise:
        loss, metrics = _dpo_term(logprobs, t, micro, denominators, cfg)
    else:
        loss, metrics = _policy_term(logprobs, t, micro, scale, cfg)
    if bonus:
        entropy_loss = agg_loss(entropy, mask, actor.loss_agg_mode, **scale)
        loss = loss - actor.entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = entropy_loss.detach() * local_scale(denominators, micro.response_mask)
    if actor.use_kl_loss:
        kl, kl_metrics = kl_loss(logprobs, t["ref_logprobs"], mask, actor.kl_loss_type, actor.loss_agg_mode, **scale)
        loss = loss + actor.kl_loss_coef * kl
        metrics["actor/kl_loss"] = kl.detach() * local_scale(denominators, micro.response_mask)
        metrics["actor/kl_coef"] = actor.kl_loss_coef
    return loss, metrics


def _policy_term(logprobs, t: dict, micro: Batch, scale: dict, cfg: Config):
    """rl.actor.policy_loss (stages/core POLICY_LOSSES) and its metrics, `actor/pg_loss` included."""
    actor, corr = cfg.rl.actor, cfg.rl.algorithm.rollout_correction
    weights, pg_mask, corr_metrics = t.get("rollout_is_weights"), t["response_mask"], {}
    if corr.bypass_mode:  # old_logprobs are the engine's: correct against the current policy (stages/rl_correction.py)
        weights, pg_mask, corr_metrics = rollout_correction(logprobs, t["old_logprobs"], pg_mask, **corr.params())
    pg_loss, pg_metrics = POLICY_LOSSES.get(actor.policy_loss.name)(
        t["old_logprobs"], logprobs, weighted_advantages(t["advantages"], weights), pg_mask, actor.loss_agg_mode,
        clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c, **scale, **actor.policy_loss.params(),
    )
    metrics = {**pg_metrics, **corr_metrics,
               "actor/pg_loss": pg_loss.detach() * local_scale(scale, micro.response_mask)}
    return pg_loss, metrics


def _dpo_term(logprobs, t: dict, micro: Batch, denominators: dict, cfg: Config):
    """DPO's loss over the mini-batch's pairs (every row of a pair batch has a model token, so the global pairs
    are half the global non-empty sequences) and its metrics, `actor/dpo_loss` included.

    TrainEngine weights micro-batch metrics by their tokens; `weight` turns this micro-batch's pair means into
    values whose token-weighted mean over the mini-batch is the mean over its pairs."""
    global_pairs = float(denominators["global_num_seqs"]) / 2
    loss, metrics = dpo_loss(logprobs, t["ref_logprobs"], t["response_mask"],
                             beta=cfg.rl.algorithm.adv_estimator.beta, global_num_pairs=global_pairs)
    local_pairs = len(micro) / 2
    weight = local_scale(denominators, micro.response_mask) * local_pairs / global_pairs
    metrics = {k: v * weight for k, v in metrics.items()}
    metrics["actor/dpo_loss"] = loss.detach() * local_scale(denominators, micro.response_mask)
    return loss, metrics
