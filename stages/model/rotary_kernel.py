"""Triton kernel of the trainer's rotary embedding on CUDA (stages/model/rotary.py says where it is used).

x (..., H, D) contiguous, cos/sin (..., D) with the same leading dims: rows of D are (token, head) pairs; a
program rotates BLOCK rows, the two halves of D loaded separately, in float32, rounded once. The token of a row
is row // H (one division per row, not per element). inverse=True applies the transposed rotation (the
gradient's). Launched through `wrap_triton`, so that torch.compile sees the kernel inside `rlpipe::rotary` (a
Triton op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 64


@triton.jit
def _rotary_kernel(X, COS, SIN, OUT, n_rows, heads, INVERSE: tl.constexpr, HALF: tl.constexpr,
                   ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = rows < n_rows
    cols = tl.arange(0, HALF)[None, :]
    x_at = rows.to(tl.int64)[:, None] * (2 * HALF) + cols
    c_at = (rows // heads).to(tl.int64)[:, None] * (2 * HALF) + cols
    mask = valid[:, None]
    x1 = tl.load(X + x_at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_at + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + c_at, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + c_at + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + c_at, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + c_at + HALF, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:  # the transpose of [[c1, -s1], [s2, c2]]
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(OUT + x_at, y1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + x_at + HALF, y2.to(OUT.dtype.element_ty), mask=mask)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x (..., H, D) rotated by cos/sin (..., D), all contiguous, D / 2 a power of two: a new tensor like x.

    The kernel sees flat tensors and writes a flat new one, viewed as x's shape after: under torch.compile with
    dynamic shapes, Inductor (torch 2.11-2.13) could restride a written tensor that has a size-1 dimension
    (the packed batch's B = 1) and copy it onto itself, failing with KeyError in Scheduler.compute_ancestors
    (pytorch#189271); a 1-D written tensor has no such dimension."""
    heads, d = x.shape[-2:]
    out = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    rows = x.numel() // d
    if rows:
        grid = (triton.cdiv(rows, ROWS),)
        torch.library.wrap_triton(_rotary_kernel)[grid](x.view(-1), cos.view(-1), sin.view(-1), out, rows, heads,
                                                        INVERSE=inverse, HALF=d // 2, ROWS=ROWS, num_warps=4)
    return out.view(x.shape)
