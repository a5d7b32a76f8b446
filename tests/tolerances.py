"""Tolerances for float32 results of the same computation done in another order, from float32's rounding.

Float32 rounds every operation to a relative u = 2^-24 = 6e-8. The same sum of n terms added in another order
(other micro-batches, ranks, threads or kernels) differs by at most about n * u * sum|terms|, and typically by
sqrt(n) * u * sum|terms| (the rounding errors add like a random walk). A wrong computation (a rank's share
missing or counted twice, a gradient averaged instead of summed) changes results by O(1) relative amounts.
"""

from __future__ import annotations

import copy

import torch

# A gradient entry sums per-token contributions over a mini-batch (~10^3 tokens), each accumulated over the
# model's widths (~10^2): reordered, it errs by ~sqrt(10^5) * u = 2e-5 of the summed magnitudes, which the
# largest entry of its tensor stands for. 1e-4 of that entry leaves a margin of 5.
REORDER_RTOL = 1e-4


def assert_close_reordered(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], msg: str = "") -> None:
    """Each tensor of `actual` (gradients, or other results of such sums) equals `expected`'s within REORDER_RTOL
    of that tensor's largest entry."""
    assert actual.keys() == expected.keys(), msg
    for name, value in expected.items():
        atol = REORDER_RTOL * float(value.abs().max())
        torch.testing.assert_close(actual[name], value, rtol=0, atol=atol, msg=lambda m, n=name: f"{msg} {n}: {m}")


def assert_close_sgd_steps(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                           before: dict[str, torch.Tensor], msg: str = "") -> None:
    """Weights after one plain SGD step from `before` (before - lr * gradient) agree: each tensor's steps within
    REORDER_RTOL of its largest step (the gradients' reordering error, times lr), plus 2 float32 ulps of its
    largest weight for the rounding of the weights. (Adam's steps need more care: see test_scale.py.)"""
    eps = torch.finfo(torch.float32).eps
    for name, value in expected.items():
        step = float((value - before[name]).abs().max())
        atol = REORDER_RTOL * step + 2 * eps * float(value.abs().max())
        torch.testing.assert_close(actual[name], value, rtol=0, atol=atol, msg=lambda m, n=name: f"{msg} {n}: {m}")


@torch.no_grad()
def greedy_margin(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]]) -> float:
    """The smallest gap between the largest and the second-largest logit where `model` chose the `responses`'
    tokens after their `prompts` (teacher-forced, in float64). Two float32 engines whose logits each stay within
    half of it of the exact ones choose the same greedy tokens: only then is comparing their tokens exactly fair."""
    exact = copy.deepcopy(model).double()
    gaps = []
    for prompt, response in zip(prompts, responses):
        logits = exact(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]  # (R, V)
        top = logits.topk(2, dim=-1).values
        gaps.append(float((top[:, 0] - top[:, 1]).min()))
    return min(gaps)
