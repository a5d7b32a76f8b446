"""Where the RL loop applies rollout correction (`rl.algorithm.rollout_correction`; the math is
stages/core/rollout_correction.py, the settings infra/rollout_correction.py).

Decoupled (verl's default mode: pi_rollout, pi_old, pi): the driver, after the advantages, compares the trainer's
old logprobs with the engine's (`corrected_batch`): the updates get `rollout_is_weights` and the mask without the
rejected tokens (the actor's and critic's losses, and their global token and sequence counts); the step's metrics
and trajectory rows keep the rollout's mask. Bypass (pi_old := pi_rollout, no old-logprob pass): the actor compares
its current logprobs (detached) with the engine's in every micro-batch (stages/workers/actor_loss.py), as verl's
`bypass_mode` loss does; the rejection masks the policy-gradient loss only, whose global token and sequence counts
stay those of the rollout's mask (verl's too).

Deviation from verl: verl replaces the response mask with the rejection mask before computing the advantages, so
its GAE and REINFORCE++ returns (and the whitening of the batch-normalised estimators) skip rejected tokens, and a
sequence whose last token is rejected loses its outcome reward from every return. Here the advantages are computed
on the rollout's mask and the rejection applies to the losses only; outcome estimators (GRPO, RLOO, ...) give the
same advantages either way.

The actor multiplies each token's policy-gradient loss by its weight (verl's `pg_losses * rollout_is_weights`) by
giving the policy loss `weights * advantages` (`weighted_advantages`): for weights > 0 (they are exp(...) >= 2e-9,
truncated, over a positive batch mean) every loss that is linear in A or a max/min of such terms (vanilla with its
dual clip, gspo, gpg, cispo) gives w * l per token (up to rounding) and the same clip fractions. clip_cov and
kl_cov read A elsewhere (the covariance that selects tokens; a KL term A does not scale), so the config refuses
weights with them (infra/rollout_correction.py `check_policy_loss`).
"""

from __future__ import annotations

import torch

from infra.rollout_correction import RolloutCorrectionConfig
from stages.batch import Batch
from stages.core.rollout_correction import rollout_correction

UNWEIGHTABLE_LOSSES = ("clip_cov", "kl_cov")  # their token selection reads the advantages


def corrected_batch(batch: Batch, corr: RolloutCorrectionConfig) -> tuple[Batch, dict[str, float]]:
    """The batch the updates train on (decoupled mode) and the `rollout_corr/*` metrics. With no weights and no
    rejection configured it is `batch` itself (metrics only); in bypass mode `batch` and no metrics (the actor
    computes them)."""
    if corr.bypass_mode:
        return batch, {}
    t = batch.tensors
    weights, kept, metrics = rollout_correction(t["old_logprobs"], t["rollout_logprobs"], batch.response_mask,
                                                **corr.params())
    metrics = {k: float(v) for k, v in metrics.items()}
    if not corr.corrects:
        return batch, metrics
    extra = {"response_mask": kept} | ({} if weights is None else {"rollout_is_weights": weights})
    return Batch({**t, **extra}, batch.meta), metrics


def weighted_advantages(advantages: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """A * w: the policy loss of these advantages is w * (its loss) per token (see the module docstring)."""
    return advantages if weights is None else advantages * weights.to(advantages.dtype)
