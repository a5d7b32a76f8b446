"""Float8 (e4m3) matmuls for the `cuda` engine's `rl.rollout.quantization=fp8`: weights with one scale per
output channel, activations with one scale per token (dynamic), one scaled matmul.

On CUDA (Hopper, Ada) the product is `torch._scaled_mm`; elsewhere it is computed in float32 from the
dequantised values, which has the same quantisation error (the CPU tests; a CUDA test compares the two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0


def quantise_rows(weight: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
    """weight (O, K) -> out (O, K) float8 e4m3 and scales (O,) in place: each row's largest |w| maps to 448."""
    row_scales = weight.abs().amax(-1).float().clamp(min=1e-12) / FP8_MAX
    scales.copy_(row_scales)
    out.copy_((weight.float() / row_scales[:, None]).to(FP8))


def linear(x: torch.Tensor, weight, bias=None) -> torch.Tensor:
    """F.linear; for weight = (float8 (O, K), scales (O,)) the rows of x are quantised to float8 with one scale
    per token (dynamic) and multiplied in one scaled matmul (`_scaled_mm`, Hopper/Ada) on CUDA, in float32 from
    the dequantised values elsewhere (the same quantisation error: CPU tests)."""
    if not isinstance(weight, tuple):
        return F.linear(x, weight, bias)
    quantised, scales = weight
    x_scales = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # (N, 1)
    x8 = (x.float() / x_scales).to(FP8)
    if x.is_cuda:
        out = torch._scaled_mm(x8, quantised.t(), scale_a=x_scales, scale_b=scales[None], out_dtype=x.dtype)
    else:
        out = ((x8.float() * x_scales) @ (quantised.float() * scales[:, None]).t()).to(x.dtype)
    return out if bias is None else out + bias
