"""Triton kernels of the training head on CUDA: token logprobs from vocabulary logits, and their gradient.

The head's logits are N x V (V ~ 150k): every pass over them moves gigabytes, so each pass is one kernel.

head_forward: one program per row, one read of the row in blocks, an online log-sum-exp (running max and
sum of exp, rescaled when the max grows) and, for the entropy, the running sum of exp(z) * z; then the
target's logit. z = logits / temperature in float32. Returns logprob, log-sum-exp and entropy (or zeros).

head_backward: d(sum grad * logprobs)/d logits = grad * (onehot(target) - softmax(z)) / T, one program per
(row, block of columns), written over the logits in place (they are recomputed for backward and not
needed after), in their dtype. The column index comes from the grid, so no per-element division.

torch.compile's versions of these passes took 2.6 ms (forward) and 4.6 ms (backward) per 8,192-token chunk
on an H200, 2-4x their bytes' time; this gradient kernel takes 1.4 ms on an H100
(bench/results/2026-11-22-gpu-update-mfu.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
BACKWARD_BLOCK = 2048


@triton.jit
def _head_forward_kernel(LOGITS, TARGETS, LOGPROBS, LSE, ENTROPY, V, stride_row, inv_t,
                         WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride_row
    cols = tl.arange(0, BLOCK)
    m = tl.full([1], -1e30, tl.float32)  # running max (finite: exp(m - m_new) stays defined)
    s = tl.zeros([1], tl.float32)  # sum of exp(z - m)
    t = tl.zeros([1], tl.float32)  # sum of exp(z - m) * z
    for start in range(0, V, BLOCK):
        valid = start + cols < V
        z = tl.load(base + start + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
        z = tl.reshape(z, [1, BLOCK])
        m_new = tl.maximum(m, tl.max(z, 1))
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new[:, None])
        s = s * alpha + tl.sum(e, 1)
        if WITH_ENTROPY:
            # e is 0 on the masked lanes; z there is -inf, so it is zeroed before the product (0 * -inf is nan)
            t = t * alpha + tl.sum(e * tl.where(tl.reshape(valid, [1, BLOCK]), z, 0.0), 1)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(TARGETS + row + tl.arange(0, 1))
    z_target = tl.load(base + target).to(tl.float32) * inv_t
    out = tl.arange(0, 1) + row
    tl.store(LOGPROBS + out, z_target - lse)
    tl.store(LSE + out, lse)
    if WITH_ENTROPY:
        tl.store(ENTROPY + out, lse - t / s)


@triton.jit
def _head_backward_kernel(LOGITS, TARGETS, LSE, GRAD, V, stride_row, inv_t, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    valid = cols < V
    ptr = LOGITS + row.to(tl.int64) * stride_row + cols
    z = tl.load(ptr, mask=valid, other=0.0).to(tl.float32) * inv_t
    p = tl.exp(z - tl.load(LSE + row))
    g = tl.load(GRAD + row).to(tl.float32) * inv_t
    grad = tl.where(cols == tl.load(TARGETS + row), g * (1.0 - p), -g * p)
    tl.store(ptr, grad.to(LOGITS.dtype.element_ty), mask=valid)


def head_forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """(logprobs, lse, entropy or zeros), float32 (N,) each, from logits (N, V) with unit column stride."""
    n, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    logprobs, lse = (torch.empty(n, device=logits.device, dtype=torch.float32) for _ in range(2))
    entropy = torch.empty_like(lse) if with_entropy else torch.zeros_like(lse)
    if n:
        _head_forward_kernel[(n,)](logits, targets.contiguous(), logprobs, lse, entropy, v, logits.stride(0),
                                   1.0 / temperature, WITH_ENTROPY=with_entropy, BLOCK=BLOCK, num_warps=8)
    return logprobs, lse, entropy


def head_backward_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """The logits' gradient (see the module docstring), written into `logits` (contiguous) and returned."""
    n, v = logits.shape
    if n:
        grid = (n, triton.cdiv(v, BACKWARD_BLOCK))
        _head_backward_kernel[grid](logits, targets.contiguous(), lse.contiguous(), grad.contiguous(), v,
                                    logits.stride(0), 1.0 / temperature, BLOCK=BACKWARD_BLOCK, num_warps=4)
    return logits
