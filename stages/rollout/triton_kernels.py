"""Triton kernels of the cuda rollout engine's decode step: split-KV attention and fused sampling.

decode_attention (flash-decoding): one query token per sequence against its first `length` cache
entries. The KV range is cut into splits of `split` positions; program (b, kv head, split) runs the
`groups` query heads of that kv head together (padded to 16 rows for the tensor cores) with an online
softmax over 64-position blocks and writes a normalised partial output and its log-sum-exp; a second
kernel combines the splits. Only the valid entries are read, and every sequence's work is spread over
many programs (a per-sequence kernel is latency-bound at decode: the flash kernel took ~46 us per layer
at 256 sequences here, for ~7 us of bytes).

sample: one pass over the bf16 logits in splits of the vocabulary per row: running max and sum of exp
(log-sum-exp), and the Gumbel-max choice argmax(x - log(-log u)) (argmax x when greedy), then a small
kernel combines the splits and gathers the chosen token's logprob. x = logits * inv_temperature in fp32.
u is a counter-based hash of (seed, row * V + column) (lowbias32, 24 bits), so no uniform tensor is
written or read: the engine bumps the seed tensor once per step (inside its CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_split_kernel(Q, K, V, LENS, O_PART, LSE_PART, scale, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                         stride_vb, stride_vt, stride_vh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                         GROUPS: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    b, kvh, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(LENS + b)
    start = s * SPLIT
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    if start < length:
        q = tl.load(Q + b * stride_qb + (kvh * GROUPS + g)[:, None] * stride_qh + d[None, :],
                    mask=(g < GROUPS)[:, None], other=0.0)
        for n0 in range(0, SPLIT, BLOCK_N):
            n = start + n0 + tl.arange(0, BLOCK_N)
            valid = n < length
            k = tl.load(K + b * stride_kb + n[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                        mask=valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale  # (GP, BLOCK_N)
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            v = tl.load(V + b * stride_vb + n[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                        mask=valid[:, None], other=0.0)
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
    lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    base = b * stride_ob + kvh * stride_oh + s * stride_os
    tl.store(O_PART + base + g[:, None] * D + d[None, :], out, mask=(g < GROUPS)[:, None])  # real heads only
    tl.store(LSE_PART + b * stride_lb + kvh * stride_lh + s * GP + g, lse, mask=g < GROUPS)


@triton.jit
def _decode_combine_kernel(O_PART, LSE_PART, OUT, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb,
                           NUM_SPLITS, GROUPS: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SP: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    kvh, g = h // GROUPS, h % GROUPS
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    used = s < NUM_SPLITS
    lse = tl.load(LSE_PART + b * stride_lb + kvh * stride_lh + s * GP + g, mask=used, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))  # split 0 is never empty: every sequence has >= 1 entry
    parts = tl.load(O_PART + b * stride_ob + kvh * stride_oh + s[:, None] * stride_os + g * D + d[None, :],
                    mask=used[:, None], other=0.0)
    out = tl.sum(weights[:, None] * parts, 0) / tl.sum(weights, 0)
    tl.store(OUT + b * stride_outb + h * D + d, out.to(OUT.dtype.element_ty))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float, split: int = 128, block_n: int = 64, num_warps: int = 4,
                     num_stages: int | None = None) -> torch.Tensor:
    """q (B, H, D) contiguous; k_cache, v_cache (B, T, H_kv, D) with unit stride in D; lengths (B,) >= 1.

    Returns (B, H, D): head h attends with kv head h // (H / H_kv) to cache positions [0, lengths[b]).
    split, block_n, num_warps, num_stages: the split kernel's tiling (bench/gpu_decode_kernels.py sweeps them).
    """
    stages = {} if num_stages is None else {"num_stages": num_stages}
    b, heads, dim = q.shape
    t, kv_heads = k_cache.shape[1], k_cache.shape[2]
    groups = heads // kv_heads
    gp = max(16, triton.next_power_of_2(groups))
    splits = triton.cdiv(t, split)
    o_part = torch.empty(b, kv_heads, splits, gp, dim, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(b, kv_heads, splits, gp, device=q.device, dtype=torch.float32)
    _decode_split_kernel[(b, kv_heads, splits)](
        q, k_cache, v_cache, lengths, o_part, lse_part, scale, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        GROUPS=groups, GP=gp, D=dim, SPLIT=split, BLOCK_N=block_n, num_warps=num_warps, **stages,
    )
    out = torch.empty_like(q)
    _decode_combine_kernel[(b, heads)](
        o_part, lse_part, out, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
        lse_part.stride(1), out.stride(0), splits, GROUPS=groups, GP=gp, D=dim,
        SP=triton.next_power_of_2(splits), num_warps=2,
    )
    return out


@triton.jit
def _write_kv_kernel(K, V, K_CACHE, V_CACHE, POS, stride_kb, stride_kh, stride_vb, stride_vh, stride_cb, stride_ct,
                     stride_ch, KV_HEADS: tl.constexpr, HP: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)
    pos = tl.load(POS + b)
    h = tl.arange(0, HP)[:, None]
    d = tl.arange(0, D)[None, :]
    mask = h < KV_HEADS
    dst = b * stride_cb + pos * stride_ct + h * stride_ch + d
    tl.store(K_CACHE + dst, tl.load(K + b * stride_kb + h * stride_kh + d, mask=mask), mask=mask)
    tl.store(V_CACHE + dst, tl.load(V + b * stride_vb + h * stride_vh + d, mask=mask), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             positions: torch.Tensor) -> None:
    """k, v (B, H_kv, D) (unit stride in D) into the caches (>= B, T, H_kv, D, same strides) at row b, positions[b]."""
    b, kv_heads, dim = k.shape
    assert k_cache.stride() == v_cache.stride() and k.stride(2) == v.stride(2) == 1
    _write_kv_kernel[(b,)](k, v, k_cache, v_cache, positions, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), KV_HEADS=kv_heads,
                           HP=triton.next_power_of_2(kv_heads), D=dim, num_warps=1)


@triton.jit
def _mix32(x):
    """lowbias32 (Chris Wellons): a 32-bit avalanche hash; x int64 in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _sample_split_kernel(LOGITS, stride_row, vocab, INV_T, SEED, PART_M, PART_S, PART_Z, PART_I, num_splits,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr):
    row, sp = tl.program_id(0), tl.program_id(1)
    inv_t = tl.load(INV_T)
    key = _mix32((tl.load(SEED) & 0xFFFFFFFF) ^ 0x9E3779B9)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int64)
    for c0 in range(0, CHUNK, BLOCK):
        col = sp * CHUNK + c0 + tl.arange(0, BLOCK)
        valid = col < vocab
        x = tl.load(LOGITS + row * stride_row + col, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, x)  # element-wise running max and sum: reduced once at the end
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - m_safe) + tl.where(valid, tl.exp(x - m_safe), 0.0)
        m = m_new
        z = x
        if not GREEDY:
            h = _mix32(((row.to(tl.int64) * vocab + col) ^ key) & 0xFFFFFFFF)
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            z = x - tl.log(-tl.log(u))
        z = tl.where(valid, z, float("-inf"))
        take = z > best
        best = tl.where(take, z, best)
        best_i = tl.where(take, col.to(tl.int64), best_i)
    row_m = tl.max(m, 0)
    row_s = tl.sum(total * tl.exp(m - tl.where(row_m == float("-inf"), 0.0, row_m)), 0)
    j = tl.argmax(best, 0)
    lane = tl.arange(0, BLOCK)
    out = row * num_splits + sp
    tl.store(PART_M + out, row_m)
    tl.store(PART_S + out, row_s)
    tl.store(PART_Z + out, tl.max(best, 0))
    tl.store(PART_I + out, tl.sum(tl.where(lane == j, best_i, 0), 0))


@triton.jit
def _sample_combine_kernel(LOGITS, stride_row, INV_T, PART_M, PART_S, PART_Z, PART_I, TOKENS, LOGPROBS, num_splits,
                           SP: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, SP)
    used = s < num_splits
    m = tl.load(PART_M + row * num_splits + s, mask=used, other=float("-inf"))
    total = tl.load(PART_S + row * num_splits + s, mask=used, other=0.0)
    z = tl.load(PART_Z + row * num_splits + s, mask=used, other=float("-inf"))
    idx = tl.load(PART_I + row * num_splits + s, mask=used, other=0)
    top = tl.max(m, 0)
    lse = top + tl.log(tl.sum(total * tl.exp(m - top), 0))
    j = tl.argmax(z, 0)
    token = tl.sum(tl.where(s == j, idx, 0), 0)
    x = tl.load(LOGITS + row * stride_row + token).to(tl.float32) * tl.load(INV_T)
    tl.store(TOKENS + row, token)
    tl.store(LOGPROBS + row, x - lse)


def sample(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: torch.Tensor,
           greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) (unit stride in V) -> tokens (B,) int64, logprobs (B,) fp32; see the module docstring."""
    rows, vocab = logits.shape
    block = 1024
    chunk = triton.cdiv(triton.cdiv(vocab, 16), block) * block  # 16 splits of the vocabulary per row
    splits = triton.cdiv(vocab, chunk)
    dev = logits.device
    part_m, part_s, part_z = (torch.empty(rows, splits, device=dev, dtype=torch.float32) for _ in range(3))
    part_i = torch.empty(rows, splits, device=dev, dtype=torch.int64)
    _sample_split_kernel[(rows, splits)](logits, logits.stride(0), vocab, inv_temperature, seed, part_m, part_s, part_z,
                                         part_i, splits, CHUNK=chunk, BLOCK=block, GREEDY=greedy, num_warps=4)
    tokens = torch.empty(rows, device=dev, dtype=torch.int64)
    logprobs = torch.empty(rows, device=dev, dtype=torch.float32)
    _sample_combine_kernel[(rows,)](logits, logits.stride(0), inv_temperature, part_m, part_s, part_z, part_i, tokens,
                                    logprobs, splits, SP=triton.next_power_of_2(splits), num_warps=1)
    return tokens, logprobs
