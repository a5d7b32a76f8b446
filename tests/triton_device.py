"""Where the Triton kernels' tests run: CUDA, or the CPU under Triton's interpreter.

`make test` runs the suite, then the tests marked `triton` again with TRITON_INTERPRET=1 and a Triton install
of their own (.venv/triton, requirements-triton.lock): the CPU venv leaves Triton out (README, The environment),
so without that second pass these kernels would be tested only on lent GPUs.
"""

from __future__ import annotations

import os

import pytest
import torch


def triton_device() -> str | None:
    """cuda, or cpu under TRITON_INTERPRET=1, when triton imports; None when the kernels cannot run here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


def needs_triton(fn):
    """Mark a test of Triton kernels: run where triton_device() is not None, selected by `-m triton`."""
    skip = pytest.mark.skipif(triton_device() is None, reason="needs triton (CUDA, or TRITON_INTERPRET=1)")
    return pytest.mark.triton(skip(fn))
