"""Triton kernels of the cuda rollout engine's decode step: attention (with the rotation and K/V write) and sampling.

decode_step_attention: the step's attention from a layer's qkv projection, one query token per sequence. With
many (sequence, kv head) pairs (at least DIRECT_MIN_PROGRAMS, i.e. about one per SM: 64 sequences of a 2-kv-head
model) one program per pair does everything: rotates its query heads and its key (after Qwen3's per-head q/k
norms), writes the new K/V at the sequence's position, runs an online softmax over the cached positions in
64-position blocks (the pair's `groups` query heads together, padded to 16 rows for the tensor cores) and adds
the new token's key and value from registers. On an H100 at 256 sequences this is 25 us a layer against 30 us
for the split kernel and its combine (54 MB of K/V: floor 17.5 us), and the separate rotation kernel (4.5 us)
is gone (bench/results/2026-11-26-gpu-decode-attention.md).

Fewer pairs: `rope_write` (rotation and K/V write in one kernel, one program per row) then `decode_attention`
(flash-decoding): the KV range is cut into splits of `split` positions; program (b, kv head, split) writes a
normalised partial output and its log-sum-exp, and a second kernel combines the splits, so that a few long
sequences still spread over many programs.

sample: one pass over the bf16 logits in 32 splits of the vocabulary per row: each split's max and sum of
exp (one exp per logit; its argmax when greedy); then one program per row combines the splits into the
log-sum-exp and draws its token by inverse transform: u * total is located first among the splits' sums,
then by a cumulative sum within the one split that holds it (an exact draw from softmax(x), with no noise per
logit). x = logits * inv_temperature in fp32. u is a hash of (seed, row) (lowbias32, 24 bits), so no
uniform tensor is written or read: the engine bumps the seed tensor once per step (inside its CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DIRECT_MIN_PROGRAMS = 128  # (sequence, kv head) pairs from which one program per pair is the faster kernel


@triton.jit
def _softmax_update(q, k, v, valid, m, total, acc, scale):
    """Online softmax: (running max m, sum of exp total, output acc) of the GP query rows q (GP, D) updated by one
    block of keys k and values v (BLOCK_N, D); `valid` (BLOCK_N,) masks positions past the sequence."""
    scores = tl.dot(q, tl.trans(k)) * scale  # (GP, BLOCK_N)
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    total = total * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, total, acc


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
    if start < length:
        m = tl.full([GP], float("-inf"), tl.float32)
        total = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        q = tl.load(Q + b * stride_qb + (kvh * GROUPS + g)[:, None] * stride_qh + d[None, :],
                    mask=(g < GROUPS)[:, None], other=0.0)
        for n0 in range(0, SPLIT, BLOCK_N):
            n = start + n0 + tl.arange(0, BLOCK_N)
            valid = n < length
            k = tl.load(K + b * stride_kb + n[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                        mask=valid[:, None], other=0.0)
            v = tl.load(V + b * stride_vb + n[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                        mask=valid[:, None], other=0.0)
            m, total, acc = _softmax_update(q, k, v, valid, m, total, acc, scale)
        # a split past the sequence's end writes nothing: the combine reads only the sequence's own splits
        base = b * stride_ob + kvh * stride_oh + s * stride_os
        tl.store(O_PART + base + g[:, None] * D + d[None, :], acc / total[:, None], mask=(g < GROUPS)[:, None])
        tl.store(LSE_PART + b * stride_lb + kvh * stride_lh + s * GP + g, m + tl.log(total), mask=g < GROUPS)


@triton.jit
def _decode_combine_kernel(O_PART, LSE_PART, LENS, OUT, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                           stride_outb, GROUPS: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SP: tl.constexpr,
                           SPLIT: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    kvh, g = h // GROUPS, h % GROUPS
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    used = s < tl.cdiv(tl.load(LENS + b), SPLIT)  # the sequence's own splits (>= 1: every length is >= 1)
    lse = tl.load(LSE_PART + b * stride_lb + kvh * stride_lh + s * GP + g, mask=used, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))
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
        o_part, lse_part, lengths, out, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
        lse_part.stride(1), out.stride(0), GROUPS=groups, GP=gp, D=dim, SP=triton.next_power_of_2(splits),
        SPLIT=split, num_warps=2,
    )
    return out


@triton.jit
def _rotate_heads(QKV, first, n, W, eps, cos, sin, d, QK_NORM: tl.constexpr, HP: tl.constexpr, D: tl.constexpr):
    """Heads [first, first + n) of one token's qkv row, rotated (after a per-head RMSNorm with Qwen3): (HP, D) fp32."""
    h = tl.arange(0, HP)[:, None]
    partner = (d + D // 2) % D
    mask = h < n
    x = tl.load(QKV + (first + h) * D + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(QKV + (first + h) * D + partner, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # stages/rollout/cuda_model.py rms_norm: weight * (x * rsqrt(mean x^2 + eps)) in the row's dtype
        dtype = QKV.dtype.element_ty
        r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        x = (tl.load(W + d).to(tl.float32) * (x * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        xp = (tl.load(W + partner).to(tl.float32) * (xp * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return x * cos + tl.where(d < D // 2, -xp, xp) * sin


@triton.jit
def _position(POS, COS, SIN, b, stride_cos, D: tl.constexpr):
    """Row b's position, the head-dim index (1, D) and the rotation's cos and sin at that position in fp32."""
    pos = tl.load(POS + b)
    d = tl.arange(0, D)[None, :]
    cos = tl.load(COS + pos * stride_cos + d).to(tl.float32)
    return pos, d, cos, tl.load(SIN + pos * stride_cos + d).to(tl.float32)


@triton.jit
def _rope_write_kernel(QKV, COS, SIN, POS, Q_OUT, K_CACHE, V_CACHE, Q_NORM, K_NORM, eps, stride_qkv, stride_cos,
                       stride_cb, stride_ct, stride_ch, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HP: tl.constexpr,
                       KP: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr):
    b = tl.program_id(0)
    pos, d, cos, sin = _position(POS, COS, SIN, b, stride_cos, D)
    row = QKV + b * stride_qkv
    dtype = Q_OUT.dtype.element_ty
    h = tl.arange(0, HP)[:, None]
    q = _rotate_heads(row, 0, HEADS, Q_NORM, eps, cos, sin, d, QK_NORM, HP, D)
    tl.store(Q_OUT + (b * HEADS + h) * D + d, q.to(dtype), mask=h < HEADS)
    k = _rotate_heads(row, HEADS, KV_HEADS, K_NORM, eps, cos, sin, d, QK_NORM, KP, D)
    hk = tl.arange(0, KP)[:, None]
    dst = b * stride_cb + pos * stride_ct + hk * stride_ch + d
    tl.store(K_CACHE + dst, k.to(dtype), mask=hk < KV_HEADS)
    v = tl.load(row + (HEADS + KV_HEADS + hk) * D + d, mask=hk < KV_HEADS)
    tl.store(V_CACHE + dst, v, mask=hk < KV_HEADS)


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, heads: int,
               k_cache: torch.Tensor, v_cache: torch.Tensor, q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """One decode token per row: qkv (B, (H + 2 H_kv) D) contiguous -> rotated q (B, H, D); k rotated and v written
    into the caches (>= B, T, H_kv, D, same strides) at row b, positions[b]. cos, sin: (T, D) tables indexed by
    position; q_norm, k_norm: Qwen3's per-head RMSNorm weights (D,), applied before the rotation."""
    b = qkv.shape[0]
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    assert qkv.is_contiguous() and k_cache.stride() == v_cache.stride() and cos.stride() == sin.stride()
    q = torch.empty(b, heads, dim, device=qkv.device, dtype=qkv.dtype)
    _rope_write_kernel[(b,)](qkv, cos, sin, positions, q, k_cache, v_cache, q_norm, k_norm, eps, qkv.stride(0),
                             cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), HEADS=heads,
                             KV_HEADS=kv_heads, HP=triton.next_power_of_2(heads),
                             KP=triton.next_power_of_2(kv_heads), D=dim, QK_NORM=q_norm is not None, num_warps=2)
    return q


@triton.jit
def _decode_direct_kernel(QKV, COS, SIN, POS, K_CACHE, V_CACHE, Q_NORM, K_NORM, OUT, eps, scale, stride_qkv,
                          stride_cos, stride_cb, stride_ct, stride_ch, stride_ob, HEADS: tl.constexpr,
                          KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                          BLOCK_N: tl.constexpr, QK_NORM: tl.constexpr):
    """Program (b, kv head): rotation, K/V write at position pos, attention over positions [0, pos] (the cached
    ones block by block, then the new token from registers: no program reads what another writes)."""
    b, kvh = tl.program_id(0), tl.program_id(1)
    pos, d, cos, sin = _position(POS, COS, SIN, b, stride_cos, D)
    row = QKV + b * stride_qkv
    dtype = OUT.dtype.element_ty
    q = _rotate_heads(row, kvh * GROUPS, GROUPS, Q_NORM, eps, cos, sin, d, QK_NORM, GP, D).to(dtype)  # (GP, D)
    k_new = tl.sum(_rotate_heads(row, HEADS + kvh, 1, K_NORM, eps, cos, sin, d, QK_NORM, 2, D), 0)[None, :]
    k_new = k_new.to(dtype)  # (1, D): the one real row of two
    v_new = tl.load(row + (HEADS + KV_HEADS + kvh) * D + d)
    pair = b * stride_cb + kvh * stride_ch
    tl.store(K_CACHE + pair + pos * stride_ct + d, k_new)
    tl.store(V_CACHE + pair + pos * stride_ct + d, v_new)
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for n0 in range(0, pos, BLOCK_N):
        valid = n0 + n < pos
        at = pair + (n0 + n)[:, None] * stride_ct + d
        k = tl.load(K_CACHE + at, mask=valid[:, None], other=0.0)
        v = tl.load(V_CACHE + at, mask=valid[:, None], other=0.0)
        m, total, acc = _softmax_update(q, k, v, valid, m, total, acc, scale)
    score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale  # (GP,): the new token's key
    m_new = tl.maximum(m, score)
    alpha = tl.exp(m - m_new)
    p = tl.exp(score - m_new)
    total = total * alpha + p
    acc = acc * alpha[:, None] + p.to(dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)
    g = tl.arange(0, GP)[:, None]
    tl.store(OUT + b * stride_ob + (kvh * GROUPS + g) * D + d, (acc / total[:, None]).to(dtype), mask=g < GROUPS)


def decode_step_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          lengths: torch.Tensor, heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                          q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                          direct: bool | None = None) -> torch.Tensor:
    """One decode token per row: qkv (B, (H + 2 H_kv) D) contiguous -> attention output (B, H, D), with the rotated
    k and v written into the caches (>= B, T, H_kv, D) at row b, positions[b]; lengths = positions + 1 (int32).
    cos, sin, q_norm, k_norm: as `rope_write`. direct: one program per (row, kv head) (default: when there are at
    least DIRECT_MIN_PROGRAMS of them), else `rope_write` and the split kernel (see the module docstring)."""
    b, kv_heads, dim = qkv.shape[0], k_cache.shape[2], k_cache.shape[3]
    if not (b * kv_heads >= DIRECT_MIN_PROGRAMS if direct is None else direct):
        q = rope_write(qkv, cos, sin, positions, heads, k_cache, v_cache, q_norm, k_norm, eps)
        return decode_attention(q, k_cache, v_cache, lengths, scale)
    assert qkv.is_contiguous() and k_cache.stride() == v_cache.stride() and cos.stride() == sin.stride()
    assert k_cache.stride(3) == 1
    groups = heads // kv_heads
    out = torch.empty(b, heads, dim, device=qkv.device, dtype=qkv.dtype)
    _decode_direct_kernel[(b, kv_heads)](
        qkv, cos, sin, positions, k_cache, v_cache, q_norm, k_norm, out, eps, scale, qkv.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), HEADS=heads, KV_HEADS=kv_heads,
        GROUPS=groups, GP=max(16, triton.next_power_of_2(groups)), D=dim, BLOCK_N=64, QK_NORM=q_norm is not None,
        num_warps=4)
    return out


@triton.jit
def _mix32(x):
    """lowbias32 (Chris Wellons): a 32-bit avalanche hash of a uint32."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _sample_split_kernel(LOGITS, stride_row, vocab, INV_T, PART_M, PART_S, PART_I, num_splits, CHUNK: tl.constexpr,
                         BLOCK: tl.constexpr, GREEDY: tl.constexpr):
    """Split `sp` of a row: its max m and sum of exp(x - m) (x = logits * inv_t), and its argmax when greedy."""
    row, sp = tl.program_id(0), tl.program_id(1)
    inv_t = tl.load(INV_T)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    for c0 in range(0, CHUNK, BLOCK):
        col = sp * CHUNK + c0 + tl.arange(0, BLOCK)
        x = tl.load(LOGITS + row * stride_row + col, mask=col < vocab, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(x, 0))  # a split's first block always has a real column
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
        if GREEDY:
            take = x > best
            best = tl.where(take, x, best)
            best_i = tl.where(take, col, best_i)
    out = row * num_splits + sp
    tl.store(PART_M + out, m)
    tl.store(PART_S + out, total)
    if GREEDY:
        j = tl.argmax(best, 0)
        tl.store(PART_I + out, tl.sum(tl.where(tl.arange(0, BLOCK) == j, best_i, 0), 0))


@triton.jit
def _sample_pick_kernel(LOGITS, stride_row, vocab, INV_T, SEED, PART_M, PART_S, PART_I, TOKENS, LOGPROBS, num_splits,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, SP: tl.constexpr, GREEDY: tl.constexpr):
    """A row's log-sum-exp from its splits, then its token: the argmax (greedy), or the first column where the
    cumulative sum of exp(x - max) reaches u * total (inverse transform; only the split holding it is scanned)."""
    row = tl.program_id(0)
    inv_t = tl.load(INV_T)
    s = tl.arange(0, SP)
    used = s < num_splits
    m = tl.load(PART_M + row * num_splits + s, mask=used, other=float("-inf"))
    top = tl.max(m, 0)
    mass = tl.load(PART_S + row * num_splits + s, mask=used, other=0.0) * tl.exp(m - top)  # relative to exp(top)
    row_total = tl.sum(mass, 0)
    if GREEDY:
        part_i = tl.load(PART_I + row * num_splits + s, mask=used, other=0)
        token = tl.sum(tl.where(s == tl.argmax(m, 0), part_i, 0), 0)
    else:
        key = _mix32(tl.load(SEED).to(tl.uint32) ^ 0x9E3779B9)
        u = ((_mix32(row.to(tl.uint32) ^ key) >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        target = u * row_total
        before = tl.cumsum(mass, 0) - mass
        chosen = tl.max(tl.where(used & (before < target) & (mass > 0), s, 0), 0)  # last split starting below it
        remaining = target - tl.sum(tl.where(s == chosen, before, 0.0), 0)
        running = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        token = tl.min(tl.full([BLOCK], 2147483647, tl.int32), 0)
        last = tl.max(tl.full([BLOCK], -1, tl.int32), 0)
        for c0 in range(0, CHUNK, BLOCK):
            col = chosen * CHUNK + c0 + tl.arange(0, BLOCK)
            x = tl.load(LOGITS + row * stride_row + col, mask=col < vocab, other=float("-inf")).to(tl.float32)
            e = tl.exp(x * inv_t - top)
            reached = (tl.cumsum(e, 0) + running >= remaining) & (e > 0)
            token = tl.minimum(token, tl.min(tl.where(reached, col, 2147483647), 0))
            last = tl.maximum(last, tl.max(tl.where(e > 0, col, -1), 0))
            running += tl.sum(e, 0)
        token = tl.where(token == 2147483647, last, token)  # rounding left the target past the split's sum
    x = tl.load(LOGITS + row * stride_row + token).to(tl.float32) * inv_t
    tl.store(TOKENS + row, token.to(tl.int64))
    tl.store(LOGPROBS + row, x - top - tl.log(row_total))


def sample(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: torch.Tensor,
           greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) (unit stride in V) -> tokens (B,) int64, logprobs (B,) fp32; see the module docstring."""
    rows, vocab = logits.shape
    block = 1024
    chunk = triton.cdiv(triton.cdiv(vocab, 32), block) * block  # 32 splits of the vocabulary per row
    splits = triton.cdiv(vocab, chunk)
    dev = logits.device
    part_m, part_s = (torch.empty(rows, splits, device=dev, dtype=torch.float32) for _ in range(2))
    part_i = torch.empty(rows, splits, device=dev, dtype=torch.int32)
    _sample_split_kernel[(rows, splits)](logits, logits.stride(0), vocab, inv_temperature, part_m, part_s, part_i,
                                         splits, CHUNK=chunk, BLOCK=block, GREEDY=greedy, num_warps=4)
    tokens = torch.empty(rows, device=dev, dtype=torch.int64)
    logprobs = torch.empty(rows, device=dev, dtype=torch.float32)
    _sample_pick_kernel[(rows,)](logits, logits.stride(0), vocab, inv_temperature, seed, part_m, part_s, part_i,
                                 tokens, logprobs, splits, CHUNK=chunk, BLOCK=block, SP=triton.next_power_of_2(splits),
                                 GREEDY=greedy, num_warps=4)
    return tokens, logprobs
