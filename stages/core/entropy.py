"""Token entropy and sampled-token log-probabilities from logits, numerically stable and memory-aware.

    log p_v = z_v - logsumexp(z)            H = logsumexp(z) - sum_v p_v z_v

Both take the logits of a chunk of positions, (..., V), e.g. (B, T, V) or (N, V) for packed tokens; the model
code calls them chunk by chunk. float32/float64 logits are processed in one vectorised pass that keeps one
extra (..., V) tensor: the softmax, which autograd needs anyway (sum_v p_v z_v is an einsum, so there is no
(..., V) product tensor). bfloat16/float16 logits are processed row by row (over the first dimension) in
float32: the float32 copy is one row, not the whole chunk, and the result is float32 (a bf16 log-prob is only
good to about 2 decimal places).

Deviation from verl: verl returns low-precision results for low-precision logits; here they are float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_FULL_PRECISION = (torch.float32, torch.float64)


def _by_rows(fn: Callable[..., torch.Tensor], logits: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """Apply `fn` at full precision: all at once for fp32/fp64 logits, else one float32 row at a time."""
    if logits.dtype in _FULL_PRECISION:
        return fn(logits, *others)
    if logits.dim() == 1:  # a single position: no rows to loop over
        return fn(logits.float(), *others)
    rows = [fn(row.float(), *(other[i] for other in others)) for i, row in enumerate(logits)]
    return torch.stack(rows)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    expected_logit = torch.einsum("...v,...v->...", probs, logits)  # sum_v p_v z_v without a (..., V) product
    return torch.logsumexp(logits, dim=-1) - expected_logit


def _logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    label_logits = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    return label_logits - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution softmax(logits) at each position.

    Args:
        logits: (..., V), e.g. (B, T, V).

    Returns:
        (...), e.g. (B, T); float32 for low-precision logits, else the logits' dtype. Differentiable.
    """
    return _by_rows(_entropy, logits)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of `labels` under softmax(logits).

    Args:
        logits: (..., V), e.g. (B, T, V).
        labels: int64 (...), e.g. (B, T), values in [0, V).

    Returns:
        (...), e.g. (B, T); float32 for low-precision logits, else the logits' dtype. Differentiable.
    """
    return _by_rows(_logprobs, logits, labels)
