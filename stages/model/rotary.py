"""Rotary position embedding for the trainer's q and k in the layout the packed attention wants.

transformers applies rotary to q and k viewed as (B, heads, T, D) (transposed views of the projections'
(B, T, heads, D) memory); the packed attention then copies them back to (T, heads, D). Compiled, that was
one fused kernel per tensor and pass, and on Hopper it ran at 4-7x its bytes' time (indexing with dynamic
sizes; 140 ms of a 1.74 s 0.5B update on an H200, bench/results/2026-11-22-s4-profile-h200-d-24k.txt).

`install(module)` replaces `apply_rotary_pos_emb` in a transformers modeling module with `apply_rotary`: when
q and k are such transposed views, one custom op (`rlpipe::rotary`, a Triton kernel on CUDA) writes the
rotated tensors straight in (B, T, heads, D) memory, so the packed attention's copy is a no-op, and its
backward is the same kernel with the inverse rotation. Anything else goes to transformers' own function.

The math is transformers': x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1) over the two
halves of D. On CUDA it is computed in float32 and rounded once (as the compiled path did); elsewhere with
transformers' expression in the input dtype.
"""

from __future__ import annotations

import logging
import sys

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x (..., H, D) rotated by cos/sin (..., D): transformers' rotation, or its transpose (the gradient's)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    if inverse:  # d/dx of x * cos + cat(-x2, x1) * sin, applied to a gradient x
        u1, u2 = (x * sin).chunk(2, dim=-1)
        return x * cos + torch.cat((u2, -u1), dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _triton_ready(x: torch.Tensor) -> bool:
    half = x.shape[-1] // 2
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and half > 0 and half & (half - 1) == 0


def _run(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool):
    q, k, cos, sin = (t.contiguous() for t in (q, k, cos, sin))
    if _triton_ready(q):
        from stages.model.rotary_kernel import rotate

        return rotate(q, cos, sin, inverse), rotate(k, cos, sin, inverse)
    return _rotate(q, cos, sin, inverse), _rotate(k, cos, sin, inverse)


# Without Triton (CPU machines) torch warns at each registration that it finds no kernels: expected, not shown.
logging.getLogger("torch._library.triton").setLevel(logging.ERROR)


@torch.library.triton_op("rlpipe::rotary", mutates_args=())
def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, T, H, D), k (B, T, H_kv, D) rotated by cos/sin (B, T, D): new contiguous tensors of their shapes. A
    Triton op: compiled graphs launch its kernel themselves (a Python custom op cost ~0.2 ms of host time per call
    on an H200)."""
    return _run(q, k, cos, sin, inverse=False)


@torch.library.triton_op("rlpipe::rotary_backward", mutates_args=())
def _rotary_backward(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    return _run(grad_q, grad_k, cos, sin, inverse=True)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3])


def _grad(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    dq, dk = _rotary_backward(grad_q, grad_k, cos, sin)
    return dq, dk, None, None


_rotary.register_autograd(_grad, setup_context=_setup)


def _fits(q, k, cos, sin) -> bool:
    """q, k (B, heads, T, D) transposed views of (B, T, heads, D) memory, cos/sin (B, T, D) of their dtype (under
    autocast transformers' product would promote to cos's) without gradient."""
    return (q.dim() == k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
            and q.dtype == k.dtype == cos.dtype == sin.dtype
            and cos.shape[:2] == (q.shape[0], q.shape[2]) and q.shape[-1] % 2 == 0
            and q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous()
            and not (cos.requires_grad or sin.requires_grad))


def apply_rotary(q, k, cos, sin):
    """transformers' rotation of q, k (B, heads, T, D) by cos/sin (B, T, D) through `rlpipe::rotary` (see
    `_fits`): (B, heads, T, D) views of new (B, T, heads, D) tensors."""
    q_out, k_out = _rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


def _routed(original):
    """`original` (a transformers `apply_rotary_pos_emb`) taking `apply_rotary` where it fits."""

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        plain = not args and kwargs.get("unsqueeze_dim", 1) == 1 and set(kwargs) <= {"unsqueeze_dim"}
        if plain and _fits(q, k, cos, sin):
            return apply_rotary(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.rlpipe_original = original
    return apply_rotary_pos_emb


def install(module_name: str) -> bool:
    """Route a transformers modeling module's `apply_rotary_pos_emb` through `apply_rotary` where it fits (once
    per module). False when the module has no such function (its model keeps its own rotary)."""
    module = sys.modules.get(module_name)
    current = getattr(module, "apply_rotary_pos_emb", None)
    if current is None:
        return False
    if not hasattr(current, "rlpipe_original"):
        module.apply_rotary_pos_emb = _routed(current)
    return True
