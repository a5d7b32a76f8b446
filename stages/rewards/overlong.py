"""DAPO's overlong reward shaping ("soft overlong punishment", DAPO paper eq. 13; verl's `DAPORewardManager`).

With L = max_response_length and B = buffer, a response of length |y| gets

    expected = L - B,    exceed = |y| - expected,    penalty = min(-exceed / B * penalty_factor, 0)

so 0 up to L - B tokens, falling linearly to -penalty_factor at L tokens. The penalty is added to the
rule reward. buffer 0 turns it off (all zeros) instead of dividing by zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def overlong_penalty(
    response_lengths: list[int] | Tensor, max_response_length: int, buffer: int, penalty_factor: float
) -> list[float]:
    """Per-response penalty (<= 0) for running into the last `buffer` tokens before `max_response_length`.

    Args:
        response_lengths: valid (unpadded) response lengths, (B,) list or 1-D tensor.
        max_response_length: the generation limit L.
        buffer: B, the number of tokens before L over which the penalty ramps up; 0: no penalty.
        penalty_factor: the penalty at exactly L tokens.
    """
    if max_response_length <= 0:
        raise ValueError(f"max_response_length={max_response_length} must be > 0")
    if not 0 <= buffer <= max_response_length:
        raise ValueError(
            f"overlong_buffer={buffer} must be in [0, max_response_length={max_response_length}]; 0 turns it off"
        )
    if penalty_factor < 0:
        raise ValueError(f"overlong_penalty_factor={penalty_factor} must be >= 0")
    lengths = response_lengths.tolist() if hasattr(response_lengths, "tolist") else list(response_lengths)
    if buffer == 0:
        return [0.0] * len(lengths)
    expected = max_response_length - buffer
    return [min(-(length - expected) / buffer * penalty_factor, 0.0) for length in lengths]
