"""`rl.algorithm.rollout_correction`: verl's `algorithm.rollout_correction` section, with verl's names and defaults.

The rollout engine's logprob of each sampled token (`rollout_logprobs`) and the trainer's (`old_logprobs`) differ
(kernels, precision, a stale engine). These settings correct the policy-gradient loss for the gap
(stages/core/rollout_correction.py has the math):

    rollout_is: token | sequence     importance weights pi_old / pi_rollout per token, or their product per sequence,
                                     truncated above at rollout_is_threshold (TIS)
    rollout_rs: token_k1, ...        rejection: tokens or whole sequences outside a bound leave the loss mask
                                     (token_k1 with "lower_upper" is IcePop; seq_mean_k1 the geometric-mean ratio)
    bypass_mode: true                no old-logprob pass: pi_old := pi_rollout, corrections against the current policy

All off by default (verl's yaml: rollout_is and rollout_rs null, bypass_mode false); the `rollout_corr/*` diagnostics
(KL and perplexity gap between the engine and the trainer) are logged anyway. verl removed the older keys
`rollout_rs_threshold_lower` and `rollout_token_veto_threshold` (verl #4544, Jan 2026): bounds are written
"lower_upper" in `rollout_rs_threshold`, and `seq_max_k2` / `seq_max_k3` reject a sequence for its worst token.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from infra.config_base import Section

RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")  # verl's SUPPORTED_ROLLOUT_RS_OPTIONS


class RolloutCorrectionConfig(Section):
    rollout_is: Literal["token", "sequence"] | None = Field(
        None, description="Importance weights pi_old / pi_rollout that multiply each token's policy-gradient loss: "
        "token (one per token) or sequence (the product over the response, the same on each token); null: none.")
    rollout_is_threshold: float = Field(
        2.0, gt=0, allow_inf_nan=False, description="Weights are truncated above at this value (TIS).")
    rollout_is_batch_normalize: bool = Field(
        False, description="Divide the truncated weights by their mean over the step's batch (tokens; sequence "
        "level: sequences), so they average 1.")
    rollout_rs: str | None = Field(
        None, description="Rejection: comma-separated criteria, each <level>_<k>: level token, seq_sum, seq_mean or "
        "seq_max (over the response's tokens), k1 = the log ratio log(pi_old / pi_rollout) bounded as a ratio, k2 = "
        "(log ratio)^2 / 2, k3 = ratio - 1 - log ratio (upper bound). Rejected tokens (token level) or sequences "
        "leave the loss mask. token_k1 with 0.5_2.0 is IcePop; null: none.")
    rollout_rs_threshold: str | float | None = Field(
        None, description="One bound per rollout_rs criterion, comma-separated (one value: for all). k1: "
        "'lower_upper' on the ratio (token: pi_old / pi_rollout, seq_sum: its product, seq_mean: its geometric mean), "
        "or one upper bound with lower = 1 / upper; k2, k3: an upper bound.")
    bypass_mode: bool = Field(
        False, description="Skip the old-logprob pass: the engine's logprobs are the old policy (pi_old = "
        "pi_rollout, so the PPO ratio is pi / pi_rollout); rollout_is and rollout_rs then compare the current policy "
        "with the engine, in each micro-batch.")
    loss_type: Literal["ppo_clip", "reinforce"] = Field(
        "ppo_clip", description="With bypass_mode: ppo_clip (rl.actor.policy_loss; its ratio is the correction, no "
        "weights) or reinforce (-w A log pi: rl.actor.policy_loss=gpg with the rollout_is weights).")

    @field_validator("rollout_rs")
    @classmethod
    def _known_options(cls, value: str | None) -> str | None:
        if value is None:
            return None
        options = list(dict.fromkeys(o.strip() for o in value.split(",") if o.strip()))
        unknown = [o for o in options if o not in RS_OPTIONS]
        if unknown or not options:
            raise ValueError(f"rollout_rs={value!r}: unknown criteria {unknown}; valid: {', '.join(RS_OPTIONS)} "
                             "(comma-separated)")
        return ",".join(options)

    @model_validator(mode="after")
    def _consistent(self) -> RolloutCorrectionConfig:
        if self.rollout_rs is not None:
            self.rejections()  # raises on a malformed threshold
        elif self.rollout_rs_threshold is not None:
            raise ValueError(f"rollout_rs_threshold={self.rollout_rs_threshold!r} without rollout_rs rejects nothing: "
                             "set rollout_rs (e.g. token_k1) or remove the threshold")
        if self.rollout_is_batch_normalize and self.rollout_is is None:
            raise ValueError("rollout_is_batch_normalize=true needs weights: set rollout_is (token or sequence)")
        if self.rollout_is_batch_normalize and self.bypass_mode:
            raise ValueError("rollout_is_batch_normalize=true with bypass_mode=true: bypass weighs each micro-batch "
                             "against the current policy as it trains, so the batch mean would be each micro-batch's "
                             "own and the update would depend on how a mini-batch is split; set one of them to false")
        if self.loss_type != "ppo_clip" and not self.bypass_mode:
            raise ValueError(f"loss_type={self.loss_type} applies only with bypass_mode=true (as in verl); without "
                             "it the loss is rl.actor.policy_loss")
        if self.bypass_mode and self.loss_type == "ppo_clip" and self.rollout_is is not None:
            raise ValueError(f"bypass_mode with loss_type=ppo_clip: the PPO ratio pi / pi_rollout is the importance "
                             f"weight, so rollout_is={self.rollout_is} would only be logged (verl applies no weights "
                             "there): set rollout_is=null, or loss_type=reinforce")
        return self

    def rejections(self) -> tuple[tuple[str, float | None, float], ...]:
        """(criterion, lower, upper) per rollout_rs criterion, verl's threshold rules; lower is None for k2/k3."""
        if self.rollout_rs is None:
            return ()
        options = self.rollout_rs.split(",")
        spec = self.rollout_rs_threshold
        if spec is None:
            raise ValueError(f"rollout_rs={self.rollout_rs} needs rollout_rs_threshold (e.g. 0.5_2.0 for k1, 0.01 "
                             "for k3)")
        parts = [str(spec)] if isinstance(spec, float | int) else [p.strip() for p in spec.split(",") if p.strip()]
        if len(parts) not in (1, len(options)):
            raise ValueError(f"rollout_rs_threshold={spec!r}: give one value for all {len(options)} criteria or one "
                             f"each ({self.rollout_rs})")
        return tuple(_bounds(option, part) for option, part in zip(options, parts * len(options)))

    def params(self) -> dict:
        """Keyword arguments of stages.core.rollout_correction.rollout_correction."""
        return {"rollout_is": self.rollout_is, "rollout_is_threshold": self.rollout_is_threshold,
                "rollout_is_batch_normalize": self.rollout_is_batch_normalize, "rejections": self.rejections()}

    @property
    def corrects(self) -> bool:
        """Whether anything changes the loss (weights or rejection); otherwise only metrics are computed."""
        return self.rollout_is is not None or self.rollout_rs is not None


def _bounds(option: str, text: str) -> tuple[str, float | None, float]:
    where = f"rollout_rs_threshold {text!r} of {option}"
    if option.endswith("k1"):
        lower_text, upper_text = text.split("_", 1) if "_" in text else (None, text)
        upper = _positive(upper_text, where)
        lower = 1.0 / upper if lower_text is None else _positive(lower_text, where)
        if not lower < upper:
            raise ValueError(f"{where}: the lower ratio bound {lower:g} must be below the upper {upper:g}")
        return option, lower, upper
    if "_" in text:
        raise ValueError(f"{where}: {option} takes one upper bound (a divergence >= 0), not 'lower_upper'")
    return option, None, _positive(text, where)


def _positive(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{where}: {text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{where}: bounds must be positive and finite, got {value:g}")
    return value


def check_policy_loss(corr: RolloutCorrectionConfig, policy_loss: str) -> None:
    """The settings that depend on rl.actor.policy_loss (RLConfig calls this)."""
    if corr.bypass_mode and corr.loss_type == "reinforce" and policy_loss != "gpg":
        raise ValueError(f"rl.algorithm.rollout_correction.loss_type=reinforce trains -w A log pi, which is "
                         f"rl.actor.policy_loss=gpg with the weights; set it (not {policy_loss})")
    if corr.rollout_is is not None and policy_loss in ("clip_cov", "kl_cov"):
        raise ValueError(f"rl.algorithm.rollout_correction.rollout_is={corr.rollout_is} with rl.actor.policy_loss="
                         f"{policy_loss} is not supported: the weights scale the advantages, which {policy_loss} "
                         "also reads to pick tokens (stages/rl_correction.py); use vanilla, gspo, gpg or cispo, or "
                         "only rejection (rollout_rs)")
