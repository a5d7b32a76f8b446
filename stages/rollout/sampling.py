"""Token sampling on the device, in the rollout engines' logprob convention (see base.py).

One pass over the logits: x = logits / T in float32, logprob of the chosen token = x[tok] - logsumexp(x),
before any top-k/top-p filtering. Sampling is the Gumbel-max trick: with u_i ~ U(0, 1) independent,
argmax_i (x_i - log(-log u_i)) is distributed as softmax(x) (the exponential race vLLM uses, in log
space). The uniforms come from torch's generator (seeded by the engine; graph-safe under CUDA graph
capture); compiled, the upcast, the scaling, both reductions and the noise transform are one kernel over
the bf16 logits and the uniforms. Greedy is argmax x with T = 1.

top-k keeps the k largest logits, top-p the smallest set of most likely tokens whose probability reaches
p (the token that crosses p is kept); both only restrict which tokens the race may pick.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingMode:
    """What changes the sampling computation (not the temperature value, which is a tensor input)."""

    greedy: bool
    top_k: int = -1
    top_p: float = 1.0


def sample_logits(logits: torch.Tensor, inv_temperature: torch.Tensor,
                  uniform: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V), uniform (B, V) float32 or None (greedy) -> tokens (B,), logprobs (B,)."""
    x = logits.float() * inv_temperature
    lse = torch.logsumexp(x, dim=-1)
    tokens = x.argmax(-1) if uniform is None else (x - torch.log(-torch.log(uniform))).argmax(-1)
    logprobs = x.gather(-1, tokens[:, None])[:, 0] - lse
    return tokens, logprobs


def restrict(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """-inf outside the top-k / top-p set of each row; x (B, V) float32."""
    if top_k > 0:
        kth = x.topk(min(top_k, x.shape[-1]), dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        drop_sorted = probs.cumsum(-1) - probs > top_p  # mass before this token already reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


class Sampler:
    """sample(logits (B, V), mode) -> tokens (B,), logprobs (B,); `inv_temperature` is a 0-d tensor input.

    fused (CUDA + Triton): plain and greedy sampling run as triton_kernels.sample (inverse transform, one
    uniform per row, a hash of (`seed`, row) rather than torch's generator); `seed` is bumped after every
    call, so a graph replay draws afresh. Top-k/top-p always take the torch path.
    """

    def __init__(self, device: torch.device, compile: bool, fused: bool = False):
        self.inv_temperature = torch.ones((), device=device)
        self.seed = torch.zeros((), device=device, dtype=torch.long)
        wrap = (lambda f: torch.compile(f, fullgraph=True)) if compile else (lambda f: f)
        self._sample = wrap(sample_logits)
        self._fused = None
        if fused:
            from stages.rollout.triton_kernels import sample

            self._fused = sample

    def set_temperature(self, temperature: float) -> None:
        self.inv_temperature.fill_(1.0 / temperature)

    def sample(self, logits: torch.Tensor, mode: SamplingMode) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fused is not None and (mode.greedy or (mode.top_k <= 0 and mode.top_p >= 1.0)):
            out = self._fused(logits, self.inv_temperature, self.seed, mode.greedy)
            self.seed.add_(1)
            return out
        if mode.greedy:
            return self._sample(logits, self.inv_temperature, None)
        uniform = torch.rand(logits.shape, device=logits.device, dtype=torch.float32)
        if mode.top_k <= 0 and mode.top_p >= 1.0:
            return self._sample(logits, self.inv_temperature, uniform)
        x = logits.float() * self.inv_temperature
        tokens = (restrict(x, mode.top_k, mode.top_p) - torch.log(-torch.log(uniform))).argmax(-1)
        logprobs = x.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(x, dim=-1)
        return tokens, logprobs
