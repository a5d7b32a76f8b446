"""The trainer's rotary op gives transformers' rotation and gradients, in the packed attention's layout."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2 import modeling_qwen2

from stages.model import rotary
from tests.triton_device import needs_triton, triton_device

HF_ROTARY = getattr(modeling_qwen2.apply_rotary_pos_emb, "rlpipe_original", modeling_qwen2.apply_rotary_pos_emb)


def _inputs(b=2, t=7, heads=4, kv_heads=2, d=16, dtype=torch.float32, device="cpu", seed=0):
    """q, k as transformers makes them (transposed views of projections), cos/sin of real positions."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, t, heads * d, generator=g, device=device).to(dtype).view(b, t, heads, d).transpose(1, 2)
    k = torch.randn(b, t, kv_heads * d, generator=g, device=device).to(dtype).view(b, t, kv_heads, d).transpose(1, 2)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, device=device).float() / d)
    positions = torch.randint(0, 300, (b, t), generator=g, device=device).float()
    freqs = torch.cat([positions[..., None] * inv_freq] * 2, dim=-1)
    return q.requires_grad_(), k.requires_grad_(), freqs.cos().to(dtype), freqs.sin().to(dtype)


def _run(fn, q, k, cos, sin, seed=1):
    q, k = (x.detach().requires_grad_() for x in (q, k))
    q_out, k_out = fn(q, k, cos, sin)
    g = torch.Generator(device=q.device).manual_seed(seed)
    loss = (q_out * torch.randn(q_out.shape, generator=g, device=q.device).to(q.dtype)).sum() + (
        k_out * torch.randn(k_out.shape, generator=g, device=q.device).to(q.dtype)).sum()
    loss.backward()
    return q_out, k_out, q.grad, k.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_op_equals_transformers_and_writes_the_attention_layout(dtype):
    inputs = _inputs(dtype=dtype)
    ours, theirs = _run(rotary.apply_rotary, *inputs), _run(HF_ROTARY, *inputs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # transformers' expression on the CPU: bit for bit
    q_out, k_out = ours[:2]
    assert q_out.transpose(1, 2).is_contiguous() and k_out.transpose(1, 2).is_contiguous()  # (B, T, heads, D)


def test_routed_function_falls_back_where_the_op_does_not_fit():
    routed = rotary._routed(HF_ROTARY)
    q, k, cos, sin = _inputs()
    q_plain, k_plain = (x.detach().contiguous() for x in (q, k))  # (B, heads, T, D) memory: not the op's layout
    assert not rotary._fits(q_plain, k_plain, cos, sin) and rotary._fits(q, k, cos, sin)
    other_layouts = (((q_plain, k_plain, cos, sin), {}), ((q, k, cos[:, None], sin[:, None]), {"unsqueeze_dim": 2}),
                     ((q.bfloat16(), k.bfloat16(), cos, sin), {}))  # float32 cos/sin promote (autocast)
    for args, kwargs in other_layouts:
        for a, b in zip(routed(*args, **kwargs), HF_ROTARY(*args, **kwargs)):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_install_routes_a_modeling_module_once():
    assert rotary.install(modeling_qwen2.__name__)
    first = modeling_qwen2.apply_rotary_pos_emb
    assert rotary.install(modeling_qwen2.__name__) and modeling_qwen2.apply_rotary_pos_emb is first
    assert first.rlpipe_original is HF_ROTARY
    assert not rotary.install("json")  # no rotary function there: nothing changed


def test_rotary_ops_registrations():
    q, k, cos, sin = _inputs()
    layout = tuple(x.detach().transpose(1, 2).requires_grad_() for x in (q, k))  # (B, T, heads, D) contiguous
    torch.library.opcheck(rotary._rotary, (*layout, cos, sin))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("d", [64, 128])
def test_triton_rotary_matches_float64(d):
    q, k, cos, sin = _inputs(b=1, t=1000, heads=14, kv_heads=2, d=d, dtype=torch.bfloat16, device="cuda")
    ours = _run(rotary.apply_rotary, q, k, cos, sin)
    exact = _run(HF_ROTARY, *(x.double() for x in (q, k, cos, sin)))
    for a, b in zip(ours, exact):
        torch.testing.assert_close(a.double(), b, atol=0.02, rtol=0.01)  # float32 math, one bf16 rounding


@needs_triton
@pytest.mark.parametrize("inverse", [False, True])
def test_triton_rotary_kernel_matches_float64(inverse):
    """The kernel itself (rotary dispatches to it on CUDA only), forward and the gradient's inverse rotation."""
    from stages.model.rotary_kernel import rotate

    q, _, cos, sin = _inputs(b=2, t=37, heads=14, kv_heads=2, d=64, dtype=torch.bfloat16, device=triton_device())
    x = q.detach().transpose(1, 2).contiguous()  # (B, T, heads, D), the op's layout
    exact = rotary._rotate(x.double(), cos.double(), sin.double(), inverse)
    torch.testing.assert_close(rotate(x, cos, sin, inverse).double(), exact, atol=0.02, rtol=0.01)
