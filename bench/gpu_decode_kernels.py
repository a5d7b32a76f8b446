"""The decode step's kernels one by one at 256 sequences (Qwen2.5-0.5B shape), against their byte floors.

    python3 bench/gpu_decode_kernels.py --out $OUT          # on the GPU machine

- attention: the split-KV Triton kernel (stages/rollout/triton_kernels.py) over a sweep of its tiling (split,
  block_n, num_warps, num_stages) on one layer's cache: 256 sequences, context lengths uniform in [100, 576]
  (mean ~338, as bench/gpu_rollout.py's decode step), max length 768;
- projections: each of a layer's four GEMMs (and the head) at M = 256 through cuBLAS (F.linear) and through
  inductor's autotuned templates (torch.compile mode max-autotune-no-cudagraphs).
Each figure: a CUDA graph of 20 back-to-back calls, replayed (the engine replays graphs too), median of 5.
Writes gpu-decode-kernels.json under --out and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import Results, cuda_time, machine, measure_ceilings  # noqa: E402

B, T, HEADS, KV_HEADS, D, HIDDEN, INTER, VOCAB = 256, 768, 14, 2, 64, 896, 4864, 151936


def graph_time(fn, calls: int = 20) -> float:
    """Seconds per call of fn() replayed in a CUDA graph of `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time(graph.replay, warmup=2, repeat=5) / calls


def attention_sweep(copy_tb_s: float) -> list[dict]:
    from stages.rollout.triton_kernels import decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, HEADS, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, T, KV_HEADS, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, T, KV_HEADS, D, device="cuda", generator=g).bfloat16()
    lengths = torch.randint(100, 577, (B,), device="cuda", generator=g, dtype=torch.int32)
    kv_bytes = int(lengths.sum()) * 2 * KV_HEADS * D * 2
    floor_s = kv_bytes / (copy_tb_s * 1e12)
    reference = decode_attention(q, k, v, lengths, D ** -0.5)
    rows = []
    grid = itertools.product((64, 128, 256, 512), (32, 64, 128), (2, 4, 8), (None, 2, 3, 4))
    for split, block_n, warps, stages in grid:
        if block_n > split:
            continue
        fn = lambda: decode_attention(q, k, v, lengths, D ** -0.5, split, block_n, warps, stages)  # noqa: E731
        try:
            out = fn()
            error = float((out.float() - reference.float()).abs().max())
            seconds = graph_time(fn)
        except Exception as exc:  # a tiling that does not compile (shared memory): recorded, skipped
            rows.append({"split": split, "block_n": block_n, "num_warps": warps, "num_stages": stages,
                         "error": repr(exc)[:200]})
            continue
        rows.append({"split": split, "block_n": block_n, "num_warps": warps, "num_stages": stages,
                     "us": seconds * 1e6, "of_floor": seconds / floor_s, "max_abs_diff": error})
    rows.append({"kv_bytes": kv_bytes, "floor_us": floor_s * 1e6})
    return rows


def gemm_sweep(copy_tb_s: float, matmul_tflops: float) -> list[dict]:
    shapes = {"qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * D, True), "o": (HIDDEN, HIDDEN, False),
              "gate_up": (HIDDEN, 2 * INTER, False), "down": (INTER, HIDDEN, False), "head": (HIDDEN, VOCAB, False)}
    rows = []
    for name, (k_dim, n_dim, bias) in shapes.items():
        x = torch.randn(B, k_dim, device="cuda").bfloat16()
        w = (torch.randn(n_dim, k_dim, device="cuda") * 0.02).bfloat16()
        b = torch.randn(n_dim, device="cuda").bfloat16() if bias else None
        floor_s = max(w.numel() * 2 / (copy_tb_s * 1e12), 2 * B * k_dim * n_dim / (matmul_tflops * 1e12))
        row = {"gemm": name, "k": k_dim, "n": n_dim, "floor_us": floor_s * 1e6}
        row["cublas_us"] = graph_time(lambda: F.linear(x, w, b)) * 1e6
        torch._dynamo.reset()
        tuned = torch.compile(lambda x: F.linear(x, w, b), mode="max-autotune-no-cudagraphs", dynamic=False)
        try:
            tuned(x)
            row["autotuned_us"] = graph_time(lambda: tuned(x)) * 1e6
        except Exception as exc:
            row["autotuned_error"] = repr(exc)[:200]
        rows.append(row)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--skip-gemm", action="store_true")
    args = p.parse_args()
    res = Results("gpu-decode-kernels", args.out)
    ceilings = measure_ceilings()
    res.add("machine", {**machine(), **ceilings})
    attention = attention_sweep(ceilings["copy_tb_s"])
    res.data["attention_rows"] = attention  # written with the next section (too long to print)
    timed = sorted((r for r in attention if "us" in r), key=lambda r: r["us"])
    current = next(r for r in attention if (r.get("split"), r.get("block_n"), r.get("num_warps"),
                                            r.get("num_stages")) == (128, 64, 4, None))
    table = [("attention floor us", attention[-1]["floor_us"], f"{attention[-1]['kv_bytes'] / 1e6:.1f} MB of K/V"),
             ("attention current (128, 64, 4, -) us", current["us"], f"{current['of_floor']:.2f}x floor")]
    for r in timed[:5]:
        table.append((f"attention ({r['split']}, {r['block_n']}, {r['num_warps']}, {r['num_stages']}) us", r["us"],
                      f"{r['of_floor']:.2f}x floor, diff {r['max_abs_diff']:.1e}"))
    if not args.skip_gemm:
        gemms = gemm_sweep(ceilings["copy_tb_s"], ceilings["bf16_matmul_tflops"])
        res.data["gemm_rows"] = gemms
        for r in gemms:
            tuned = r.get("autotuned_us", float("nan"))
            table.append((f"{r['gemm']} (K {r['k']}, N {r['n']}) cublas | autotuned | floor us",
                          f"{r['cublas_us']:.1f} | {tuned:.1f} | {r['floor_us']:.1f}", ""))
    res.add("summary", {"attention_configs": len(attention), "best_attention": timed[0]})
    res.table(table)


if __name__ == "__main__":
    main()
