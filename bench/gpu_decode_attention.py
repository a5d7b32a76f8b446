"""Decode attention at 256 sequences, the engine's kernel beside variants, and an Nsight Compute view of the
step's heavy kernels (issue 17's decode bar: attention is 0.75 of the step's 2.05 ms against a 0.44 ms floor).

    python3 bench/gpu_decode_attention.py --out $OUT                       # timings (CUDA graphs)
    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio --csv --page details \
        python3 bench/gpu_decode_attention.py --ncu > $OUT/ncu.csv           # one launch of each kernel
    TRITON_INTERPRET=1 PYTHONPATH=. .venv/bin/python bench/gpu_decode_attention.py --check   # CPU: equality only

Workload: the engine's decode step at full batch (bench/gpu_rollout.py `decode_step_seconds`): 256 sequences,
Qwen2.5-0.5B's attention (14 query heads, 2 kv heads, head dim 64), cache positions uniform in [128, 704), so
each call reads ~54 MB of K/V. A timed graph runs 24 calls, each on its own layer's cache (as the step does: no
call finds another's K/V in L2). Variants (kernels below, equal to the engine's within bf16 rounding):

- split: stages/rollout/triton_kernels.py's split-KV kernel and its combine, at given tilings (labelled
  "(engine)" at the engine's tiling: since 2026-11-26 the engine runs it below DIRECT_MIN_PROGRAMS pairs only;
  above, `decode_step_attention`'s program per pair, the "direct" variant here with the rotation added);
- direct: one program per (sequence, kv head) over the whole sequence, writing the output itself (no partials,
  no combine); `order` launches the longest sequences first (the engine knows the order once per step);
- fused: the split kernel whose last program to finish for a (sequence, kv head) combines the splits (an
  atomic counter per pair, reset by that program), so there is no second kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.rollout.triton_kernels import _softmax_update, decode_attention  # noqa: E402

B, T, HEADS, KV_HEADS, D, LAYERS = 256, 768, 14, 2, 64, 24
LOW, HIGH = 128, 704  # positions of the engine's decode-step measurement


@triton.jit
def _attend_block(q, K, V, n, length, kb, vb, stride_kt, stride_vt, d, m, total, acc, scale):
    """One block of positions n (BLOCK_N,) of one kv head: the online-softmax update of (m, total, acc)."""
    valid = n < length
    k = tl.load(K + kb + n[:, None] * stride_kt + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(V + vb + n[:, None] * stride_vt + d[None, :], mask=valid[:, None], other=0.0)
    return _softmax_update(q, k, v, valid, m, total, acc, scale)


@triton.jit
def _prefetch_kernel(Q, K, V, LENS, OUT, scale, stride_qb, stride_kb, stride_kt, stride_vb, stride_vt, stride_ob,
                     GROUPS: tl.constexpr, GP: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                     BLOCK_N: tl.constexpr, ALL_HEADS: tl.constexpr):
    """One program per sequence (ALL_HEADS: every kv head at once, q block-diagonal over the kv heads' columns, so
    each block is whole cache rows) or per (sequence, kv head); the next block's K/V are loaded before this one's
    math (explicit prefetch: two blocks in flight per program)."""
    b = tl.program_id(0)
    length = tl.load(LENS + b)
    if ALL_HEADS:
        first = 0
        C: tl.constexpr = KV_HEADS * D
        R: tl.constexpr = KV_HEADS * GP
    else:
        first = tl.program_id(1) * D
        C: tl.constexpr = D
        R: tl.constexpr = GP
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    row_kv = r // GP + (0 if ALL_HEADS else tl.program_id(1))  # each row's kv head
    head = row_kv * GROUPS + r % GP
    real = (r % GP) < GROUPS
    # q block-diagonal: row r holds head `head` in its kv head's columns (all of them when one kv head)
    col_kv = (first + c) // D
    own = real[:, None] & (col_kv[None, :] == row_kv[:, None])
    q = tl.load(Q + b * stride_qb + head[:, None] * D + ((first + c) % D)[None, :], mask=own, other=0.0)
    m = tl.full([R], float("-inf"), tl.float32)
    total = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, C], tl.float32)
    n = tl.arange(0, BLOCK_N)
    kp = K + b * stride_kb + n[:, None] * stride_kt + first + c[None, :]
    vp = V + b * stride_vb + n[:, None] * stride_vt + first + c[None, :]
    k_next = tl.load(kp, mask=(n < length)[:, None], other=0.0)
    v_next = tl.load(vp, mask=(n < length)[:, None], other=0.0)
    for n0 in range(0, length, BLOCK_N):
        k, v = k_next, v_next
        ahead = (n0 + BLOCK_N + n < length)[:, None]
        k_next = tl.load(kp + (n0 + BLOCK_N) * stride_kt, mask=ahead, other=0.0)
        v_next = tl.load(vp + (n0 + BLOCK_N) * stride_vt, mask=ahead, other=0.0)
        m, total, acc = _softmax_update(q, k, v, n0 + n < length, m, total, acc, scale)
    out = acc / total[:, None]
    if ALL_HEADS:  # row r's own kv head's columns
        out = tl.sum(tl.reshape(tl.where(own, out, 0.0), (R, KV_HEADS, D)), 1)
    d = tl.arange(0, D)
    tl.store(OUT + b * stride_ob + head[:, None] * D + d[None, :], out.to(OUT.dtype.element_ty), mask=real[:, None])


def prefetch_attention(q, k_cache, v_cache, lengths, scale, all_heads=False, block_n=64, num_warps=4, num_stages=1):
    b, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    groups = heads // kv_heads
    assert k_cache.stride(2) == dim and v_cache.stride(2) == dim and q.is_contiguous()
    gp = triton.next_power_of_2(groups)
    gp = max(gp, 16 // kv_heads) if all_heads else max(gp, 16)
    out = torch.empty_like(q)
    _prefetch_kernel[(b,) if all_heads else (b, kv_heads)](
        q, k_cache, v_cache, lengths, out, scale, q.stride(0), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), GROUPS=groups, GP=gp, KV_HEADS=kv_heads, D=dim,
        BLOCK_N=block_n, ALL_HEADS=all_heads, num_warps=num_warps, num_stages=num_stages)
    return out


@triton.jit
def _direct_kernel(Q, K, V, LENS, ORDER, OUT, scale, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                   stride_vb, stride_vt, stride_vh, stride_ob, stride_oh, GROUPS: tl.constexpr, GP: tl.constexpr,
                   D: tl.constexpr, BLOCK_N: tl.constexpr, ORDERED: tl.constexpr):
    pid, kvh = tl.program_id(0), tl.program_id(1)
    b = tl.load(ORDER + pid) if ORDERED else pid
    length = tl.load(LENS + b)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + (kvh * GROUPS + g)[:, None] * stride_qh + d[None, :], mask=(g < GROUPS)[:, None],
                other=0.0)
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    kb, vb = b * stride_kb + kvh * stride_kh, b * stride_vb + kvh * stride_vh
    for n0 in range(0, length, BLOCK_N):
        m, total, acc = _attend_block(q, K, V, n0 + tl.arange(0, BLOCK_N), length, kb, vb, stride_kt, stride_vt, d,
                                      m, total, acc, scale)
    out = acc / total[:, None]
    tl.store(OUT + b * stride_ob + (kvh * GROUPS + g)[:, None] * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
             mask=(g < GROUPS)[:, None])


def direct_attention(q, k_cache, v_cache, lengths, scale, order=None, block_n=64, num_warps=4, num_stages=None):
    b, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    groups = heads // kv_heads
    out = torch.empty_like(q)
    stages = {} if num_stages is None else {"num_stages": num_stages}
    _direct_kernel[(b, kv_heads)](
        q, k_cache, v_cache, lengths, lengths if order is None else order, out, scale, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), out.stride(0), out.stride(1), GROUPS=groups, GP=max(16, triton.next_power_of_2(groups)),
        D=dim, BLOCK_N=block_n, ORDERED=order is not None, num_warps=num_warps, **stages)
    return out


@triton.jit
def _fused_split_kernel(Q, K, V, LENS, O_PART, LSE_PART, COUNT, OUT, scale, stride_qb, stride_qh, stride_kb,
                        stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_outb, GROUPS: tl.constexpr,
                        GP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, SP: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """Split s of (b, kv head): partial output and log-sum-exp; the pair's last split to finish combines them."""
    b, kvh, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(LENS + b)
    num_splits = tl.cdiv(length, SPLIT)
    if s < num_splits:
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        real = (g < GROUPS)[:, None]
        q = tl.load(Q + b * stride_qb + (kvh * GROUPS + g)[:, None] * stride_qh + d[None, :], mask=real, other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        total = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        kb, vb = b * stride_kb + kvh * stride_kh, b * stride_vb + kvh * stride_vh
        for n0 in range(0, SPLIT, BLOCK_N):
            m, total, acc = _attend_block(q, K, V, s * SPLIT + n0 + tl.arange(0, BLOCK_N), length, kb, vb, stride_kt,
                                          stride_vt, d, m, total, acc, scale)
        out_rows = (kvh * GROUPS + g)[:, None] * D + d[None, :]
        if num_splits == 1:  # the whole sequence in one split: the output directly
            tl.store(OUT + b * stride_outb + out_rows, (acc / total[:, None]).to(OUT.dtype.element_ty), mask=real)
        else:
            pair = b * tl.num_programs(1) + kvh
            part = (pair * SP + s) * GP
            tl.store(O_PART + (part + g)[:, None] * D + d[None, :], acc / total[:, None], mask=real)
            tl.store(LSE_PART + part + g, m + tl.log(total), mask=g < GROUPS)
            tl.debug_barrier()  # every thread's stores before the release below
            if tl.atomic_add(COUNT + pair, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                tl.store(COUNT + pair, 0)  # ready for the next call (the engine replays graphs)
                sp = tl.arange(0, SP)
                used = sp < num_splits
                rows = (pair * SP + sp)[:, None] * GP + g[None, :]  # (SP, GP)
                lse = tl.load(LSE_PART + rows, mask=used[:, None] & (g < GROUPS)[None, :], other=float("-inf"),
                              cache_modifier=".cg")
                top = tl.max(lse, 0)  # (GP,)
                top = tl.where(top == float("-inf"), 0.0, top)
                weights = tl.exp(lse - top[None, :])  # (SP, GP)
                combined = tl.zeros([GP, D], tl.float32)
                for j in range(0, num_splits):
                    w = tl.sum(tl.where(sp[:, None] == j, weights, 0.0), 0)  # (GP,)
                    o = tl.load(O_PART + ((pair * SP + j) * GP + g)[:, None] * D + d[None, :], mask=real, other=0.0,
                                cache_modifier=".cg")
                    combined += w[:, None] * o
                combined = combined / tl.sum(weights, 0)[:, None]
                tl.store(OUT + b * stride_outb + out_rows, combined.to(OUT.dtype.element_ty), mask=real)


class FusedAttention:
    """The fused split kernel with its buffers (allocated once per shape, as the engine would)."""

    def __init__(self, batch: int, kv_heads: int, groups: int, dim: int, max_len: int, split: int, device):
        self.gp = max(16, triton.next_power_of_2(groups))
        self.split, self.splits = split, triton.cdiv(max_len, split)
        self.sp = triton.next_power_of_2(self.splits)
        self.o_part = torch.empty(batch * kv_heads * self.sp * self.gp * dim, device=device, dtype=torch.float32)
        self.lse_part = torch.empty(batch * kv_heads * self.sp * self.gp, device=device, dtype=torch.float32)
        self.count = torch.zeros(batch * kv_heads, device=device, dtype=torch.int32)

    def __call__(self, q, k_cache, v_cache, lengths, scale, block_n=64, num_warps=4, num_stages=None):
        b, heads, dim = q.shape
        kv_heads = k_cache.shape[2]
        out = torch.empty_like(q)
        stages = {} if num_stages is None else {"num_stages": num_stages}
        _fused_split_kernel[(b, kv_heads, self.splits)](
            q, k_cache, v_cache, lengths, self.o_part, self.lse_part, self.count, out, scale, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), out.stride(0), GROUPS=heads // kv_heads, GP=self.gp, D=dim, SPLIT=self.split,
            SP=self.sp, BLOCK_N=block_n, num_warps=num_warps, **stages)
        return out


def reference(q, k_cache, v_cache, lengths, scale):
    """Softmax attention in float32, one sequence at a time."""
    groups = q.shape[1] // k_cache.shape[2]
    out = []
    for i, n in enumerate(lengths.tolist()):
        k = k_cache[i, :n].float().repeat_interleave(groups, 1)  # (n, H, D)
        v = v_cache[i, :n].float().repeat_interleave(groups, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), k) * scale, -1)
        out.append(torch.einsum("hn,nhd->hd", w, v))
    return torch.stack(out)


def inputs(batch, max_len, layers, device, dtype, low, high, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    lengths = torch.randint(low, high, (batch,), device=device, generator=g, dtype=torch.int32) + 1
    q = [torch.randn(batch, HEADS, D, device=device, generator=g).to(dtype) for _ in range(layers)]
    k = [torch.randn(batch, max_len, KV_HEADS, D, device=device, generator=g).to(dtype) for _ in range(layers)]
    v = [torch.randn(batch, max_len, KV_HEADS, D, device=device, generator=g).to(dtype) for _ in range(layers)]
    return q, k, v, lengths


def variants(batch, max_len, device):
    """name -> fn(q, k, v, lengths, scale, order): each variant's call."""
    fused = {split: FusedAttention(batch, KV_HEADS, HEADS // KV_HEADS, D, max_len, split, device)
             for split in (128, 256)}
    out = {"split 128,64,4 (engine)": lambda q, k, v, n, s, o: decode_attention(q, k, v, n, s)}
    for split, block, warps, stages in ((256, 64, 4, 2), (128, 64, 4, 1), (256, 128, 8, 2)):
        out[f"split {split},{block},{warps},{stages}"] = (
            lambda q, k, v, n, s, o, a=(split, block, warps, stages): decode_attention(q, k, v, n, s, *a))
    for block, warps, stages in ((64, 4, None), (64, 4, 2), (64, 4, 4), (128, 4, 2), (128, 8, 3), (32, 2, 3)):
        for ordered in (False, True):
            name = f"direct {block},{warps},{stages}" + (" ordered" if ordered else "")
            out[name] = lambda q, k, v, n, s, o, a=(block, warps, stages), r=ordered: direct_attention(
                q, k, v, n, s, o if r else None, *a)
    for all_heads in (False, True):
        for block, warps, stages in ((64, 4, 1), (32, 4, 1), (64, 8, 1), (128, 8, 1), (64, 4, 2)):
            name = f"prefetch{' all-heads' if all_heads else ''} {block},{warps},{stages}"
            out[name] = lambda q, k, v, n, s, o, a=(all_heads, block, warps, stages): prefetch_attention(
                q, k, v, n, s, *a)
    for split in fused:
        for block, warps, stages in ((64, 4, None), (64, 4, 2)):
            out[f"fused {split},{block},{warps},{stages}"] = (
                lambda q, k, v, n, s, o, f=fused[split], a=(block, warps, stages): f(q, k, v, n, s, *a))
    return out


def check(device, dtype) -> None:
    """Every variant equals float32 softmax attention (small sizes)."""
    q, k, v, lengths = inputs(8, 300, 1, device, dtype, 1, 299)
    lengths[0], lengths[1] = 1, 300  # one position; the whole cache
    scale = D ** -0.5
    want = reference(q[0], k[0], v[0], lengths, scale)
    order = torch.argsort(lengths, descending=True).to(torch.int32)
    for name, fn in variants(8, 300, device).items():
        for _ in range(2):  # the second call checks that the fused kernel's counters were reset
            got = fn(q[0], k[0], v[0], lengths, scale, order).float()
        err = (got - want).abs().max().item()
        print(f"{name:32s} max |diff| {err:.2e}", flush=True)
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4), name


def timings(args) -> None:
    from bench.gpu_common import Results, machine, measure_ceilings
    from bench.gpu_decode_kernels import graph_time

    res = Results("gpu-decode-attention", args.out)
    ceilings = measure_ceilings()
    res.add("machine", {**machine(), **ceilings})
    q, k, v, lengths = inputs(B, T, LAYERS, "cuda", torch.bfloat16, LOW, HIGH)
    scale = D ** -0.5
    calls = variants(B, T, "cuda")
    rows = []
    for b in args.batches:  # the first b sequences (the engine's smaller buckets)
        n = lengths[:b].contiguous()
        order = torch.argsort(n, descending=True).to(torch.int32)
        kv_bytes = int(n.sum()) * 2 * KV_HEADS * D * 2
        floor_us = kv_bytes / (ceilings["copy_tb_s"] * 1e12) * 1e6
        res.add(f"b{b}", {"kv_mb_per_call": kv_bytes / 1e6, "floor_us": floor_us})
        rows.append((f"{b} sequences: floor, us", floor_us, f"{kv_bytes / 1e6:.1f} MB a call"))
        want = [decode_attention(q[i][:b], k[i][:b], v[i][:b], n, scale) for i in range(LAYERS)]
        for name, fn in calls.items():
            def layers(fn=fn):
                for i in range(LAYERS):
                    fn(q[i][:b], k[i][:b], v[i][:b], n, scale, order)

            def measure(fn=fn, name=name):
                diff = max((fn(q[i][:b], k[i][:b], v[i][:b], n, scale, order).float() - want[i].float()).abs().max()
                           .item() for i in range(LAYERS))
                us = graph_time(layers, calls=1) / LAYERS * 1e6
                res.add(f"b{b} {name}", {"us": us, "of_floor": us / floor_us, "max_abs_diff_to_engine": diff})
                rows.append((f"  {name}, us", us, f"{us / floor_us:.2f}x floor, diff {diff:.1e}"))

            res.attempt(f"b{b} {name}", measure)
    res.table(rows)


@torch.no_grad()
def ncu_targets() -> None:
    """One launch of each heavy kernel of the step between cudaProfilerStart/Stop (run under ncu)."""
    import torch.nn.functional as F

    from stages.rollout.triton_kernels import rope_write, sample

    q, k, v, lengths = inputs(B, T, 2, "cuda", torch.bfloat16, LOW, HIGH)
    order = torch.argsort(lengths, descending=True).to(torch.int32)
    chosen = {n: f for n, f in variants(B, T, "cuda").items()
              if n in ("split 128,64,4 (engine)", "direct 64,4,None", "prefetch 64,4,1", "prefetch all-heads 64,8,1")}
    hidden, inter, vocab = 896, 4864, 151936
    gemms = {name: (torch.randn(B, kk, device="cuda").bfloat16(), (torch.randn(nn, kk, device="cuda") * .02).bfloat16())
             for name, kk, nn in (("qkv", hidden, (HEADS + 2 * KV_HEADS) * D), ("o", hidden, hidden),
                                  ("gate_up", hidden, 2 * inter), ("down", inter, hidden), ("head", hidden, vocab))}
    qkv = torch.randn(B, (HEADS + 2 * KV_HEADS) * D, device="cuda").bfloat16()
    cos, sin = torch.randn(T, D, device="cuda").bfloat16(), torch.randn(T, D, device="cuda").bfloat16()
    logits = torch.randn(B, vocab, device="cuda").bfloat16()
    inv_t, seed = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda", dtype=torch.int64)
    steps = [*(lambda f=f: f(q[1], k[1], v[1], lengths, D ** -0.5, order) for f in chosen.values()),
             *(lambda x=x, w=w: F.linear(x, w) for x, w in gemms.values()),
             lambda: rope_write(qkv, cos, sin, lengths.long() - 1, HEADS, k[0], v[0]),
             lambda: sample(logits, inv_t, seed, greedy=False)]
    for fn in steps:  # compile and warm up outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for fn in steps:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join([*chosen, *gemms, "rope_write", "sample"]), file=sys.stderr)


NCU_FIGURES = ("Duration", "DRAM Throughput", "Memory Throughput", "L2 Hit Rate", "Registers Per Thread",
               "Achieved Occupancy", "Theoretical Occupancy", "Block Limit Registers", "Block Limit Shared Mem",
               "Waves Per SM", "Warp Cycles Per Issued Instruction")


def ncu_summary(path: str) -> None:
    """Nsight Compute's details CSV -> a line per kernel: the figures above and its three largest stall reasons."""
    import csv
    import io

    text = Path(path).read_text()
    rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
    kernels: dict[str, dict] = {}
    for r in rows:
        k = kernels.setdefault(r["ID"], {"name": r["Kernel Name"][:60], "grid": r["Grid Size"],
                                         "block": r["Block Size"]})
        k[r["Metric Name"]] = f"{r['Metric Value']} {r['Metric Unit']}".strip()
    for k in kernels.values():
        stalls = sorted(((float(v.split()[0].replace(",", "")), name.split("stalled_")[1].split("_per_")[0])
                         for name, v in k.items() if "issue_stalled_" in name), reverse=True)[:3]
        figures = "; ".join(f"{f} {k.get(f, '-')}" for f in NCU_FIGURES)
        print(f"{k['name']} grid {k['grid']} block {k['block']}\n    {figures}\n    stalls: "
              + ", ".join(f"{n} {v:.1f}" for v, n in stalls))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[256, 128, 64])
    p.add_argument("--ncu", action="store_true", help="one launch of each kernel, for Nsight Compute")
    p.add_argument("--summarise", metavar="CSV", help="print the kernels of an Nsight Compute details CSV")
    p.add_argument("--check", action="store_true", help="equality of the variants only (CPU: TRITON_INTERPRET=1)")
    args = p.parse_args()
    if args.summarise:
        ncu_summary(args.summarise)
    elif args.check:
        cuda = torch.cuda.is_available()
        check("cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    elif args.ncu:
        ncu_targets()
    else:
        timings(args)


if __name__ == "__main__":
    main()
