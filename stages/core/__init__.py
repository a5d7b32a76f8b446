"""The pure math of RL post-training, with verl's semantics: tensors in, `(tensor, metrics)` out.

No config objects, no `.item()`, no collectives, no in-place changes to inputs. Shapes: B sequences, T
response tokens, V vocabulary; `response_mask` is bool (B, T).

    registry      Registry: named key -> callable maps with duplicate checks and helpful errors.
    masked        masked_sum/mean/var/whiten, agg_loss (4 modes, explicit global denominators),
                  loss_denominators.
    groups        dense group ids and per-group statistics for outcome estimators.
    advantages    one plain function per advantage estimator.
    estimators    AdvantageInputs, ADV_ESTIMATORS and compute_advantages: the loop's one call convention.
    policy_loss   POLICY_LOSSES: vanilla, gspo, gpg, cispo (+ the call convention).
    dpo           online DPO: preference_pairs, pair_order, preference_advantages (the `online_dpo`
                  estimator's labels), dpo_loss.
    cov_losses    clip_cov, kl_cov (registered into POLICY_LOSSES).
    kl            KL_ESTIMATORS, kl_penalty, apply_kl_penalty, kl_loss, KL controllers.
    entropy       entropy_from_logits, logprobs_from_logits.
    value_loss    clipped_value_loss.
    rollout_correction  rollout_correction: importance weights and rejection masks for the engine/trainer
                  logprob gap, off-policy metrics (imported from the module, not re-exported here).
"""

from stages.core.advantages import (
    gae_advantages,
    gpg_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    opo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from stages.core.cov_losses import clip_cov_policy_loss, kl_cov_policy_loss
from stages.core.dpo import Pairs, dpo_loss, pair_order, preference_advantages, preference_pairs
from stages.core.entropy import entropy_from_logits, logprobs_from_logits
from stages.core.estimators import ADV_ESTIMATORS, AdvantageInputs, compute_advantages
from stages.core.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)
from stages.core.masked import (
    LOSS_AGG_MODES,
    agg_loss,
    loss_denominators,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from stages.core.policy_loss import (
    POLICY_LOSSES,
    cispo_policy_loss,
    gpg_policy_loss,
    gspo_policy_loss,
    vanilla_policy_loss,
)
from stages.core.registry import Registry
from stages.core.value_loss import clipped_value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "FixedKLController",
    "Pairs",
    "Registry",
    "agg_loss",
    "apply_kl_penalty",
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "clipped_value_loss",
    "compute_advantages",
    "dpo_loss",
    "entropy_from_logits",
    "gae_advantages",
    "gpg_advantages",
    "gpg_policy_loss",
    "grpo_advantages",
    "grpo_passk_advantages",
    "gspo_policy_loss",
    "kl_cov_policy_loss",
    "kl_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "loss_denominators",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "opo_advantages",
    "pair_order",
    "preference_advantages",
    "preference_pairs",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "vanilla_policy_loss",
]
