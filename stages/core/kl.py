"""KL estimators between the policy and the reference model, KL in the reward or as a loss, KL controllers.

With d = log pi - log pi_ref per sampled token (J. Schulman, "Approximating KL divergence", 2020):

    k1 / kl            d                                   unbiased, high variance, can be negative
    abs                |d|
    k2 / mse           d^2 / 2                             gradient is the true KL gradient
    k3 / low_var_kl    exp(-d) - (-d) - 1                  unbiased, low variance, >= 0; -d clamped to
                                                           [-20, 20] and the result to [-10, 10] (verl)
    <key>+             straight-through: the forward value of <key> with the gradient of k2
                       (k2 - sg(k2) + sg(<key>)); verl's fix for k1/k3's biased gradients

KL can enter training two ways (verl): `apply_kl_penalty` subtracts beta * KL from the token rewards before
advantage estimation (`algorithm.use_kl_in_reward`), with beta from a `FixedKLController` or an
`AdaptiveKLController` (Ziegler et al. 2019, arXiv 1909.08593); `kl_loss` adds an aggregated KL term to the
actor loss (`actor.use_kl_loss`), GRPO's choice.

Deviation from verl: values under the mask are replaced before the estimator runs, so garbage there cannot
reach a result or a gradient; a fully masked sequence contributes KL 0 to `actor/reward_kl_penalty`
instead of NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from stages.core.masked import Count, agg_loss, masked_mean
from stages.core.registry import Registry

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1: log pi - log pi_ref, same shape as the inputs."""
    return logprobs - ref_logprobs


def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """|log pi - log pi_ref|."""
    return (logprobs - ref_logprobs).abs()


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2: (log pi - log pi_ref)^2 / 2."""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3: exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1, clamped as in verl."""
    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


def _straight_through(forward: KLFn) -> KLFn:
    """The value of `forward`, the gradient of k2."""

    def estimator(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
        backward = kl_k2(logprobs, ref_logprobs)
        return backward - backward.detach() + forward(logprobs, ref_logprobs).detach()

    estimator.__qualname__ = f"straight_through({forward.__name__})"
    return estimator


for _keys, _fn in ((("k1", "kl"), kl_k1), (("abs",), kl_abs), (("k2", "mse"), kl_k2), (("k3", "low_var_kl"), kl_k3)):
    for _key in _keys:
        KL_ESTIMATORS.register(_key)(_fn)
        KL_ESTIMATORS.register(_key + "+")(_straight_through(_fn))
del _keys, _fn, _key


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate.

    Args:
        logprobs: (B, T) log pi of the sampled tokens.
        ref_logprobs: (B, T) log pi_ref of the same tokens.
        kl_type: A key of `KL_ESTIMATORS` (k1, kl, abs, k2, mse, k3, low_var_kl, each also with "+").

    Returns:
        (B, T) estimate; nothing is masked here.

    Raises:
        ValueError: Unknown `kl_type` (the message lists the valid keys).
    """
    return KL_ESTIMATORS.get(kl_type)(logprobs, ref_logprobs)


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_type: str = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL in the reward: token_level_rewards = token_level_scores - kl_coef * KL (KL 0 under the mask).

    Args:
        token_level_scores: (B, T) scores from the reward function (outcome score on the last valid token).
        old_logprobs: (B, T) log pi of the rollout policy.
        ref_logprobs: (B, T) log pi_ref.
        response_mask: bool (B, T).
        kl_coef: beta, e.g. a KL controller's `value`.
        kl_type: A key of `KL_ESTIMATORS`.

    Returns:
        token_level_rewards: (B, T).
        metrics: `actor/reward_kl_penalty`, the mean over sequences of each sequence's mean KL (feed it to
        the controller's `update`), and `actor/reward_kl_penalty_coeff` = kl_coef.
    """
    mask = response_mask.bool()
    kl = torch.where(mask, kl_penalty(old_logprobs, ref_logprobs, kl_type), 0.0)
    rewards = token_level_scores - kl_coef * kl
    current_kl = masked_mean(kl, mask, dim=-1).mean()
    coef = torch.tensor(kl_coef, dtype=current_kl.dtype, device=current_kl.device)
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": coef}


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_type: str,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL as a loss: agg_loss(kl_penalty(logprobs, ref_logprobs)); the caller multiplies by kl_loss_coef.

    Args:
        logprobs: (B, T) log pi (with gradient).
        ref_logprobs: (B, T) log pi_ref.
        response_mask: bool (B, T).
        kl_type: A key of `KL_ESTIMATORS`; verl's default for the loss is low_var_kl (k3).
        loss_agg_mode: See `masked.agg_loss`.
        global_num_tokens: See `masked.agg_loss`.
        global_num_seqs: See `masked.agg_loss`.
        max_response_length: See `masked.agg_loss`.

    Returns:
        (scalar loss, {"actor/kl_loss": detached loss}).
    """
    mask = response_mask.bool()
    kl = kl_penalty(torch.where(mask, logprobs, 0.0), torch.where(mask, ref_logprobs, 0.0), kl_type)
    loss = agg_loss(
        kl, mask, loss_agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, max_response_length=max_response_length,
    )  # fmt: skip
    return loss, {"actor/kl_loss": loss.detach()}


class FixedKLController:
    """A constant KL coefficient.

    Args:
        kl_coef: beta >= 0.
    """

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef={kl_coef} must be >= 0")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (same interface as `AdaptiveKLController.update`)."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the observed KL towards `target_kl` (arXiv 1909.08593, verl's rule).

    update: e = clip(current_kl / target_kl - 1, -0.2, 0.2);  value *= 1 + e * n_steps / horizon.

    Args:
        init_kl_coef: Initial beta >= 0.
        target_kl: Target KL > 0 (per token, as `actor/reward_kl_penalty` measures it).
        horizon: Steps (sequences) over which a 20% error changes beta by 20%; > 0.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef={init_kl_coef} must be >= 0")
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl={target_kl} and horizon={horizon} must both be > 0")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta; `current_kl` is a host float (the loop reads the metric once per step).

        Args:
            current_kl: Observed KL, e.g. `actor/reward_kl_penalty`.
            n_steps: Sequences in the batch that produced it (verl passes the batch size).
        """
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def make_kl_controller(
    kind: Literal["fixed", "adaptive"], kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build the controller `kind` ("fixed" or "adaptive"; adaptive needs target_kl and horizon)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(f"adaptive KL control needs target_kl and horizon; got {target_kl=}, {horizon=}")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"KL controller kind={kind!r} is not supported; use 'fixed' or 'adaptive'")
