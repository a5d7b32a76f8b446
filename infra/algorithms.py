"""Advantage estimators and policy losses as typed config variants (pydantic discriminated unions on `name`).

Each variant holds its own parameters and declares what the loop must provide for it, so the RL stage plans from
the declarations (`needs_critic`, `needs_greedy_baseline`, `needs_reference`, `pairwise`) instead of comparing names:

    rl.algorithm.adv_estimator: grpo                      # a name alone: the variant with its defaults
    rl.algorithm.adv_estimator: {name: gae, lam: 0.95}    # or the variant with parameters
    rl.actor.policy_loss: {name: kl_cov, kl_cov_ratio: 0.0002, ppo_kl_coef: 0.1}

On the command line `rl.algorithm.adv_estimator=gae rl.algorithm.adv_estimator.lam=0.95` works in either order
(infra/config.py `apply_override`: a name given where a variant stands becomes `{name: ...}`; a parameter set
under a name keeps it). A parameter the chosen variant does not have is an error naming the variant's fields.

Defaults are verl's where the name is verl's (`gamma`, `lam`, `norm_adv_by_std_in_grpo`; Clip-Cov and KL-Cov:
verl's `actor.policy_loss.*` defaults). Each variant's name is a key of the math's registry in `stages/core`
(`ADV_ESTIMATORS`, `POLICY_LOSSES`); a test checks that the two lists are the same.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field


class _Variant(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    name: str

    def params(self) -> dict[str, Any]:
        """The variant's parameters as keyword arguments of its function in stages/core."""
        return self.model_dump(exclude={"name"})


def as_variant(value: Any, default: str) -> Any:
    """A bare name (a recipe's `adv_estimator: grpo`) -> {name: grpo}; parameters without a name are the default
    variant's; anything else unchanged."""
    if isinstance(value, str):
        return {"name": value}
    if isinstance(value, dict) and "name" not in value:
        return {"name": default, **value}
    return value


# ---- advantage estimators -----------------------------------------------------------------------------


class _Estimator(_Variant):
    needs_critic: ClassVar[bool] = False  # values from a critic (GAE)
    needs_greedy_baseline: ClassVar[bool] = False  # a greedy response's score per prompt (ReMax)
    needs_reference: ClassVar[bool] = False  # reference logprobs, whatever the KL settings (online DPO)
    pairwise: ClassVar[bool] = False  # the actor trains on (chosen, rejected) pairs with the DPO loss (online DPO)
    min_group_size: ClassVar[int] = 1  # samples per prompt it needs (rl.rollout.n)
    # each sample's advantage is measured against its own group (rewards all equal: advantages 0); a group of one
    # keeps its raw score, as in verl (no baseline)
    group_relative: ClassVar[bool] = False


def _gamma():
    return Field(1.0, ge=0, le=1, description="Discount factor of returns.")


def _grpo_std():
    return Field(True, description="Divide by the group's std (false: Dr.GRPO's scaling).")


def _epsilon():
    return Field(1e-6, gt=0, description="Added to the group std.")


class GAE(_Estimator):
    needs_critic: ClassVar[bool] = True
    name: Literal["gae"] = "gae"
    gamma: float = _gamma()
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")


class GRPO(_Estimator):
    group_relative: ClassVar[bool] = True
    name: Literal["grpo"] = "grpo"
    norm_adv_by_std_in_grpo: bool = _grpo_std()
    epsilon: float = _epsilon()


class DrGRPO(_Estimator):
    """GRPO without the std division (Dr.GRPO); pair with loss_agg_mode=seq-mean-token-sum-norm."""

    group_relative: ClassVar[bool] = True
    name: Literal["dr_grpo"] = "dr_grpo"


class GRPOPassK(_Estimator):
    group_relative: ClassVar[bool] = True
    name: Literal["grpo_passk"] = "grpo_passk"
    min_group_size: ClassVar[int] = 2  # the best sample against the second best
    norm_adv_by_std_in_grpo: bool = _grpo_std()
    epsilon: float = _epsilon()


class RLOO(_Estimator):
    group_relative: ClassVar[bool] = True
    name: Literal["rloo"] = "rloo"


class OPO(_Estimator):
    group_relative: ClassVar[bool] = True
    name: Literal["opo"] = "opo"


class GPGEstimator(_Estimator):
    group_relative: ClassVar[bool] = True
    name: Literal["gpg"] = "gpg"


class ReinforcePlusPlus(_Estimator):
    name: Literal["reinforce_plus_plus"] = "reinforce_plus_plus"
    gamma: float = _gamma()


class ReinforcePlusPlusBaseline(_Estimator):
    group_relative: ClassVar[bool] = True
    name: Literal["reinforce_plus_plus_baseline"] = "reinforce_plus_plus_baseline"


class ReMax(_Estimator):
    needs_greedy_baseline: ClassVar[bool] = True
    name: Literal["remax"] = "remax"


class OnlineDPO(_Estimator):
    """Online DPO: of each group's n samples the best and the worst by reward form a (chosen, rejected) pair (no pair
    where they are equal), and the actor minimises DPO's loss against the reference instead of rl.actor.policy_loss:
    -log sigmoid(beta * [(log pi - log pi_ref)(chosen) - (log pi - log pi_ref)(rejected)]), sequence logprobs summed
    over the model's tokens (stages/core/dpo.py). Its "advantages" are the preference labels: +1 on the chosen
    sample, -1 on the rejected one, 0 elsewhere."""

    needs_reference: ClassVar[bool] = True
    pairwise: ClassVar[bool] = True
    group_relative: ClassVar[bool] = True  # a group whose rewards are all equal makes no pair
    name: Literal["online_dpo"] = "online_dpo"
    beta: float = Field(0.1, gt=0, allow_inf_nan=False,
                        description="DPO's beta: the inverse temperature of the preference (TRL's default 0.1).")

    def params(self) -> dict[str, Any]:
        """The labels take no parameter; `beta` is the loss's (stages/workers/actor_loss.py reads it)."""
        return {}


AdvEstimator = Annotated[
    GAE | GRPO | DrGRPO | GRPOPassK | RLOO | OPO | GPGEstimator | ReinforcePlusPlus | ReinforcePlusPlusBaseline
    | ReMax | OnlineDPO,
    Field(discriminator="name"),
]


# ---- policy losses --------------------------------------------------------------------------------------


class _PolicyLoss(_Variant):
    pass


class Vanilla(_PolicyLoss):
    """PPO's clipped surrogate with dual clip (clip ratios: rl.actor.clip_ratio_*)."""

    name: Literal["vanilla"] = "vanilla"


class GSPO(_PolicyLoss):
    name: Literal["gspo"] = "gspo"


class GPGLoss(_PolicyLoss):
    name: Literal["gpg"] = "gpg"


class CISPO(_PolicyLoss):
    name: Literal["cispo"] = "cispo"


class ClipCov(_PolicyLoss):
    name: Literal["clip_cov"] = "clip_cov"
    clip_cov_ratio: float = Field(0.0002, gt=0, le=1, description="Share of tokens detached from the gradient.")
    clip_cov_lb: float = Field(1.0, description="Lower bound of the covariance of tokens that may be detached.")
    clip_cov_ub: float = Field(5.0, description="Upper bound of that covariance.")


class KLCov(_PolicyLoss):
    name: Literal["kl_cov"] = "kl_cov"
    kl_cov_ratio: float = Field(0.0002, gt=0, le=1, description="Share of tokens (top covariance) KL-penalised.")
    ppo_kl_coef: float = Field(0.1, ge=0, description="Weight of |log ratio| on those tokens.")


PolicyLoss = Annotated[Vanilla | GSPO | GPGLoss | CISPO | ClipCov | KLCov, Field(discriminator="name")]


def variant_names(union: Any) -> list[str]:
    """The names a discriminated union accepts (for tests and error messages)."""
    return [m.model_fields["name"].default for m in get_args(get_args(union)[0])]
