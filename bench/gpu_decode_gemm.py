"""The decode step's projections at M = 256 (Qwen2.5-0.5B shape): cuBLAS against split-K Triton matmuls whose
partial sums the next pointwise kernel adds, and against one gate/up kernel with SiLU in its epilogue.

    python3 bench/gpu_decode_gemm.py --out $OUT          # on the GPU machine

Every figure is a CUDA graph of calls that each take a different copy of the weight (copies totalling > 2x the
L2 cache), so weights come from HBM as in the real step, where a layer's K/V reads evict the previous layer's
weights; the input x is the same (the previous kernel has just written it). Median of 5 replays.

The consumer columns: what the kernel after the projection costs (the residual add and RMSNorm, compiled by
inductor) reading one bf16 output, or summing the splits' fp32 partials first: the split-K cost is
gemm + (consumer with partials - consumer with bf16).

The kernels (tried for the engine and not kept: bench/results/2026-11-25-gpu-decode-gemm.md): `splitk` cuts K
into `splits` chunks so that more programs read the weights at once, and writes fp32 partial sums
(splits, M, N); `gate_up_silu` multiplies by the gate and up halves of the MLP's first weight in one program per
output tile and writes silu(gate) * up (M, I).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import Results, graph_seconds, machine, measure_ceilings  # noqa: E402

M, HIDDEN, INTER, HEADS, KV_HEADS, D = 256, 896, 4864, 14, 2, 64
SHAPES = {"qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * D), "o": (HIDDEN, HIDDEN), "down": (INTER, HIDDEN)}
L2_BYTES = 50 * 2 ** 20


@triton.jit
def _splitk_kernel(X, W, P, M, N, K, stride_xm, stride_wn, stride_ps, stride_pm, K_CHUNK,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    pid_m, pid_n, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in tl.range(s * K_CHUNK, s * K_CHUNK + K_CHUNK, BK, num_stages=STAGES):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=(rm < M)[:, None] & (rk < K)[None, :], other=0.0)
        w = tl.load(W + rn[:, None] * stride_wn + rk[None, :], mask=(rn < N)[:, None] & (rk < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(P + s * stride_ps + rm[:, None] * stride_pm + rn[None, :], acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


def splitk(x: torch.Tensor, w: torch.Tensor, splits: int, bm: int = 64, bn: int = 128, bk: int = 64,
           warps: int = 4, stages: int = 3) -> torch.Tensor:
    """x (M, K), w (N, K), both with unit stride in K -> fp32 partial products (splits, M, N): their sum is x @ w.T."""
    m, k = x.shape
    n = w.shape[0]
    chunk = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, chunk)
    parts = torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
    _splitk_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), splits)](
        x, w, parts, m, n, k, x.stride(0), w.stride(0), parts.stride(0), parts.stride(1),
        K_CHUNK=chunk, BM=bm, BN=bn, BK=bk, STAGES=stages, num_warps=warps)
    return parts


@triton.jit
def _gate_up_kernel(X, W, OUT, M, I, K, stride_xm, stride_wn, stride_om, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, STAGES: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    gate = tl.zeros([BM, BN], tl.float32)
    up = tl.zeros([BM, BN], tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        rk = k0 + tl.arange(0, BK)
        xm = (rm < M)[:, None] & (rk < K)[None, :]
        wm = (rn < I)[:, None] & (rk < K)[None, :]
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=xm, other=0.0)
        wg = tl.load(W + rn[:, None] * stride_wn + rk[None, :], mask=wm, other=0.0)
        wu = tl.load(W + (rn + I)[:, None] * stride_wn + rk[None, :], mask=wm, other=0.0)
        gate = tl.dot(x, tl.trans(wg), gate)
        up = tl.dot(x, tl.trans(wu), up)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(OUT + rm[:, None] * stride_om + rn[None, :], out.to(OUT.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < I)[None, :])


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, bm: int = 128, bn: int = 64, bk: int = 64, warps: int = 8,
                 stages: int = 3) -> torch.Tensor:
    """x (M, K), w (2I, K) [gate; up] -> silu(x @ gate.T) * (x @ up.T), (M, I) in x's dtype."""
    m, k = x.shape
    inter = w.shape[0] // 2
    out = torch.empty(m, inter, device=x.device, dtype=x.dtype)
    _gate_up_kernel[(triton.cdiv(m, bm), triton.cdiv(inter, bn))](
        x, w, out, m, inter, k, x.stride(0), w.stride(0), out.stride(0), BM=bm, BN=bn, BK=bk, STAGES=stages,
        num_warps=warps)
    return out


def copies(k: int, n: int) -> list[torch.Tensor]:
    count = max(4, -(-2 * L2_BYTES // (k * n * 2)))
    return [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(count)]


def graph_time(fns) -> float:
    """Seconds per call over one CUDA graph that calls each of fns once."""
    return graph_seconds(lambda: [fn() for fn in fns]) / len(fns)


def rms(h, w):
    hf = h.float()
    return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


def consumer_times(n: int, splits: list[int]) -> dict:
    """The residual add + RMSNorm after an (M, n) projection: from a bf16 output, or from fp32 partials."""
    h, w = torch.randn(M, n, device="cuda").bfloat16(), torch.ones(n, device="cuda").bfloat16()
    plain = torch.compile(lambda h, y: rms(h + y, w), dynamic=False)
    summed = torch.compile(lambda h, p: rms(h + p.sum(0).to(h.dtype), w), dynamic=False)
    y = torch.randn(M, n, device="cuda").bfloat16()
    out = {"bf16_us": graph_time([lambda: plain(h, y)] * 20) * 1e6}
    for s in splits:
        p = torch.randn(s, M, n, device="cuda")
        out[f"partials{s}_us"] = graph_time([lambda: summed(h, p)] * 20) * 1e6
    return out


def splitk_rows(name: str, k: int, n: int, copy_tb_s: float) -> list[dict]:
    ws = copies(k, n)
    x = torch.randn(M, k, device="cuda").bfloat16()
    floor_us = k * n * 2 / (copy_tb_s * 1e12) * 1e6
    ref = F.linear(x, ws[0]).float()
    rows = [{"gemm": name, "kernel": "cublas", "us": graph_time([lambda w=w: F.linear(x, w) for w in ws]) * 1e6,
             "floor_us": floor_us}]
    tiles = ((64, 64), (64, 128), (128, 64), (128, 128))
    grid = itertools.product(tiles, ((64, 3), (64, 4), (128, 2), (128, 3)), (4, 8), (1, 2, 4, 8, 16))
    for (bm, bn), (bk, stages), warps, s in grid:
        if s * bk > k:
            continue
        cfg = dict(splits=s, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages)
        try:
            err = float((splitk(x, ws[0], **cfg).sum(0) - ref).abs().max())
            us = graph_time([lambda w=w: splitk(x, w, **cfg) for w in ws]) * 1e6
        except Exception as exc:  # a tiling that does not fit (shared memory, registers): recorded
            rows.append({"gemm": name, **cfg, "error": repr(exc)[:160]})
            continue
        rows.append({"gemm": name, "kernel": "splitk", **cfg, "us": us, "floor_us": floor_us, "max_abs_diff": err})
    return rows


def gate_up_rows(copy_tb_s: float) -> list[dict]:
    ws = copies(HIDDEN, 2 * INTER)
    x = torch.randn(M, HIDDEN, device="cuda").bfloat16()
    floor_us = HIDDEN * 2 * INTER * 2 / (copy_tb_s * 1e12) * 1e6
    silu_mul = torch.compile(lambda y: F.silu(y[:, :INTER]) * y[:, INTER:], dynamic=False)
    ref = silu_mul(F.linear(x, ws[0])).float()
    rows = [{"gemm": "gate_up", "kernel": "cublas", "floor_us": floor_us,
             "us": graph_time([lambda w=w: F.linear(x, w) for w in ws]) * 1e6},
            {"gemm": "gate_up", "kernel": "cublas+silu", "floor_us": floor_us,
             "us": graph_time([lambda w=w: silu_mul(F.linear(x, w)) for w in ws]) * 1e6}]
    for bm, bn, bk, warps, stages in itertools.product((64, 128, 256), (32, 64, 128), (64,), (4, 8), (3, 4)):
        if bm * bn > 128 * 128:
            continue
        cfg = dict(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages)
        try:
            err = float((gate_up_silu(x, ws[0], **cfg).float() - ref).abs().max())
            us = graph_time([lambda w=w: gate_up_silu(x, w, **cfg) for w in ws]) * 1e6
        except Exception as exc:
            rows.append({"gemm": "gate_up", **cfg, "error": repr(exc)[:160]})
            continue
        rows.append({"gemm": "gate_up", "kernel": "fused", **cfg, "us": us, "floor_us": floor_us, "max_abs_diff": err})
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    res = Results("gpu-decode-gemm", args.out)
    ceilings = measure_ceilings()
    res.add("machine", {**machine(), **ceilings})
    table, rows = [], []
    for name, (k, n) in SHAPES.items():
        found = splitk_rows(name, k, n, ceilings["copy_tb_s"])
        rows += found
        best = min((r for r in found if r.get("kernel") == "splitk"), key=lambda r: r["us"])
        table.append((f"{name} cublas | best splitk us", f"{found[0]['us']:.1f} | {best['us']:.1f}",
                      f"floor {best['floor_us']:.1f}; splits {best['splits']} bm {best['bm']} bn {best['bn']} "
                      f"bk {best['bk']} w {best['warps']} st {best['stages']}"))
        used = sorted({r["splits"] for r in found if r.get("kernel") == "splitk"})
        cons = consumer_times(n, used)
        res.add(f"consumer_{name}", cons)
        summed = cons[f"partials{best['splits']}_us"]
        table.append((f"{name} consumer bf16 | partials{best['splits']} us", f"{cons['bf16_us']:.1f} | {summed:.1f}",
                      ""))
    found = gate_up_rows(ceilings["copy_tb_s"])
    rows += found
    best = min((r for r in found if r.get("kernel") == "fused"), key=lambda r: r["us"])
    table.append(("gate_up cublas | cublas+silu | best fused us",
                  f"{found[0]['us']:.1f} | {found[1]['us']:.1f} | {best['us']:.1f}",
                  f"floor {best['floor_us']:.1f}; bm {best['bm']} bn {best['bn']} bk {best['bk']} w {best['warps']} "
                  f"st {best['stages']}"))
    res.data["rows"] = rows
    res.add("summary", {"configs": len(rows)})
    res.table(table)


if __name__ == "__main__":
    main()
