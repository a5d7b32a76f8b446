"""The advantage-estimator registry and its one call convention.

The RL loop does not know which tensors or scalars an estimator needs. It builds one `AdvantageInputs`
(the batch's tensors; optional ones None) and calls

    advantages, returns = compute_advantages(name, inputs, gamma=..., lam=..., epsilon=...,
                                             norm_adv_by_std_in_grpo=...)

Every entry of `ADV_ESTIMATORS` has that signature: `(inputs, *, gamma, lam, epsilon,
norm_adv_by_std_in_grpo) -> (advantages, returns)`. Each entry reads the scalars its algorithm defines and
ignores the rest (the table below); a tensor it needs but finds None raises a `ValueError` naming it.

    key                            tensors used                           scalars used
    gae                            rewards, mask, values                  gamma, lam
    grpo                           rewards, mask, index                   epsilon, norm_adv_by_std_in_grpo
    dr_grpo                        rewards, mask, index                   (grpo without the std division)
    grpo_passk                     rewards, mask, index                   epsilon, norm_adv_by_std_in_grpo
    rloo, opo, gpg                 rewards, mask, index                   -
    reinforce_plus_plus            rewards, mask                          gamma
    reinforce_plus_plus_baseline   rewards, mask, index                   -
    remax                          rewards, mask, reward_baselines        -
    online_dpo                     rewards, mask, index                   - (labels +1/-1/0; see `dpo`)

The math lives in `stages.core.advantages`, one plain function per estimator, for direct use and tests.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stages.core import advantages as adv
from stages.core import dpo
from stages.core.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no truth value
class AdvantageInputs:
    """The batch tensors an advantage estimator may read.

    Attributes:
        token_level_rewards: (B, T) scores plus any per-token KL penalty; outcome scores on the last valid
            token (rewards under the mask are ignored).
        response_mask: bool (B, T), True on the model's own response tokens; False on tool/user tokens of a
            multi-turn response (holes) and on padding.
        index: (B,) group id per sequence (prompt uid): tensor, numpy array or list of hashables.
        values: (B, T) critic values of the rollout (GAE).
        reward_baselines: (B,) greedy-response scores (ReMax).
    """

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    index: Sequence[Hashable] | torch.Tensor | None = None
    values: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None

    def require(self, field: str, estimator: str) -> Any:
        """The attribute `field`, or a ValueError saying that `estimator` needs it."""
        value = getattr(self, field)
        if value is None:
            raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.{field}, which is None")
        return value


def compute_advantages(
    estimator: str,
    inputs: AdvantageInputs,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the registered estimator `estimator` on `inputs`.

    Args:
        estimator: A key of `ADV_ESTIMATORS`.
        inputs: The batch tensors.
        gamma: Discount factor (gae, reinforce_plus_plus).
        lam: GAE lambda (gae).
        epsilon: Added to group stds (grpo, grpo_passk).
        norm_adv_by_std_in_grpo: Divide by the group std (grpo, grpo_passk).

    Returns:
        (advantages, returns), each (B, T), zero under the mask.

    Raises:
        ValueError: Unknown estimator (the message lists the valid keys) or a needed tensor is None.
    """
    fn = ADV_ESTIMATORS.get(estimator)
    return fn(inputs, gamma=gamma, lam=lam, epsilon=epsilon, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)


# Entries: keyword scalars are the common convention above; unused ones are deliberately ignored.


@ADV_ESTIMATORS.register("gae")
def _gae(x: AdvantageInputs, *, gamma: float, lam: float, epsilon: float, norm_adv_by_std_in_grpo: bool):
    values = x.require("values", "gae")
    return adv.gae_advantages(x.token_level_rewards, values, x.response_mask, gamma=gamma, lam=lam)


@ADV_ESTIMATORS.register("grpo")
def _grpo(x: AdvantageInputs, *, gamma: float, lam: float, epsilon: float, norm_adv_by_std_in_grpo: bool):
    index = x.require("index", "grpo")
    return adv.grpo_advantages(x.token_level_rewards, x.response_mask, index, epsilon, norm_adv_by_std_in_grpo)


@ADV_ESTIMATORS.register("dr_grpo")
def _dr_grpo(x: AdvantageInputs, *, gamma: float, lam: float, epsilon: float, norm_adv_by_std_in_grpo: bool):
    index = x.require("index", "dr_grpo")
    return adv.grpo_advantages(x.token_level_rewards, x.response_mask, index, epsilon, norm_adv_by_std_in_grpo=False)


@ADV_ESTIMATORS.register("grpo_passk")
def _grpo_passk(x: AdvantageInputs, *, gamma: float, lam: float, epsilon: float, norm_adv_by_std_in_grpo: bool):
    index = x.require("index", "grpo_passk")
    return adv.grpo_passk_advantages(
        x.token_level_rewards, x.response_mask, index, epsilon, norm_adv_by_std_in_grpo
    )


@ADV_ESTIMATORS.register("rloo")
def _rloo(x: AdvantageInputs, *, gamma: float, lam: float, epsilon: float, norm_adv_by_std_in_grpo: bool):
    return adv.rloo_advantages(x.token_level_rewards, x.response_mask, x.require("index", "rloo"))


@ADV_ESTIMATORS.register("opo")
def _opo(x: AdvantageInputs, *, gamma: float, lam: float, epsilon: float, norm_adv_by_std_in_grpo: bool):
    return adv.opo_advantages(x.token_level_rewards, x.response_mask, x.require("index", "opo"))


@ADV_ESTIMATORS.register("gpg")
def _gpg(x: AdvantageInputs, *, gamma: float, lam: float, epsilon: float, norm_adv_by_std_in_grpo: bool):
    return adv.gpg_advantages(x.token_level_rewards, x.response_mask, x.require("index", "gpg"))


@ADV_ESTIMATORS.register("reinforce_plus_plus")
def _rpp(x: AdvantageInputs, *, gamma: float, lam: float, epsilon: float, norm_adv_by_std_in_grpo: bool):
    return adv.reinforce_plus_plus_advantages(x.token_level_rewards, x.response_mask, gamma=gamma)


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
def _rpp_baseline(x: AdvantageInputs, *, gamma: float, lam: float, epsilon: float, norm_adv_by_std_in_grpo: bool):
    index = x.require("index", "reinforce_plus_plus_baseline")
    return adv.reinforce_plus_plus_baseline_advantages(x.token_level_rewards, x.response_mask, index)


@ADV_ESTIMATORS.register("remax")
def _remax(x: AdvantageInputs, *, gamma: float, lam: float, epsilon: float, norm_adv_by_std_in_grpo: bool):
    baselines = x.require("reward_baselines", "remax")
    return adv.remax_advantages(x.token_level_rewards, baselines, x.response_mask)


@ADV_ESTIMATORS.register("online_dpo")
def _online_dpo(x: AdvantageInputs, *, gamma: float, lam: float, epsilon: float, norm_adv_by_std_in_grpo: bool):
    return dpo.preference_advantages(x.token_level_rewards, x.response_mask, x.require("index", "online_dpo"))
