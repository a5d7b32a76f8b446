"""Do the decode step's matmuls run faster with their weights in L2, and does the attention kernel's prefetch put
them there? (stages/rollout/triton_kernels.py `decode_step_attention(prefetch=...)`, 0.5B shape, 256 sequences)

    python3 bench/gpu_decode_l2.py --out $OUT        # on the GPU machine; writes gpu-decode-l2.json

- matmuls: each of a layer's four projections through F.linear at M = 256, cold (a CUDA graph over 24 copies of
  the weight, every call reads it from HBM, as in the step) and hot (24 calls on one copy: from L2 after the first);
- attention: the direct kernel over 24 layers' caches (positions uniform in [128, 704), as the engine's step
  figure) with and without pulling the next matmuls' weights (o, gate/up, down, next qkv: 29.7 MB) into L2;
- chain: 24 layers of attention -> o -> gate/up -> SiLU x up -> down -> qkv, with and without the prefetch.
Each figure: median of 5 replays of one CUDA graph, per layer (us).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import cuda_time, machine  # noqa: E402
from stages.rollout import triton_kernels  # noqa: E402

B, T, HEADS, KV_HEADS, D, HIDDEN, INTER, LAYERS = 256, 768, 14, 2, 64, 896, 4864, 24


def per_call_us(fns) -> float:
    """Microseconds per call over one CUDA graph that calls each of fns once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns[:3]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return cuda_time(graph.replay, warmup=2, repeat=5) / len(fns) * 1e6


def weights(n: int, k: int) -> list[torch.Tensor]:
    return [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(LAYERS)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    args = p.parse_args()
    torch.manual_seed(0)
    qkv_n = (HEADS + 2 * KV_HEADS) * D
    layer = {"qkv": weights(qkv_n, HIDDEN), "o": weights(HIDDEN, HIDDEN), "gate_up": weights(2 * INTER, HIDDEN),
             "down": weights(HIDDEN, INTER)}
    x = {"qkv": HIDDEN, "o": HIDDEN, "gate_up": HIDDEN, "down": INTER}
    result = {"machine": machine(), "matmul_us": {}}
    for name, ws in layer.items():
        a = torch.randn(B, x[name], device="cuda").bfloat16()
        cold = per_call_us([lambda w=w: F.linear(a, w) for w in ws])
        hot = per_call_us([lambda: F.linear(a, ws[0]) for _ in ws])
        result["matmul_us"][name] = {"cold": cold, "hot": hot}

    g = torch.Generator(device="cuda").manual_seed(1)
    caches = [torch.randn(2, B, T, KV_HEADS, D, device="cuda", generator=g).bfloat16() for _ in range(LAYERS)]
    positions = torch.randint(128, 704, (B,), device="cuda", generator=g)
    lengths = (positions + 1).to(torch.int32)
    angles = torch.arange(T, device="cuda")[:, None] * torch.rand(D // 2, device="cuda", generator=g).repeat(2)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    qkv_in = torch.randn(B, qkv_n, device="cuda", generator=g).bfloat16()

    def after(i):
        return [layer["o"][i], layer["gate_up"][i], layer["down"][i]] + ([layer["qkv"][i + 1]] if i + 1 < LAYERS
                                                                            else [])

    def attend(i, prefetch):
        return triton_kernels.decode_step_attention(qkv_in, cos, sin, positions, lengths, HEADS, caches[i][0],
                                                    caches[i][1], D ** -0.5, direct=True,
                                                    prefetch=after(i) if prefetch else ())

    def chain(i, prefetch):
        attn = attend(i, prefetch).view(B, HEADS * D)
        h = F.linear(attn, layer["o"][i])
        gate, up = F.linear(h, layer["gate_up"][i]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, layer["down"][i])
        return F.linear(h, layer["qkv"][(i + 1) % LAYERS])

    for prefetch in (False, True, False, True):
        key = "prefetch" if prefetch else "plain"
        result.setdefault("attention_us", {}).setdefault(key, []).append(
            per_call_us([lambda i=i: attend(i, prefetch) for i in range(LAYERS)]))
        result.setdefault("chain_us", {}).setdefault(key, []).append(
            per_call_us([lambda i=i: chain(i, prefetch) for i in range(LAYERS)]))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-decode-l2.json").write_text(json.dumps(result, indent=1))
    print(f"{'matmul':<10}{'cold us':>10}{'hot us':>10}")
    for name, r in result["matmul_us"].items():
        print(f"{name:<10}{r['cold']:>10.2f}{r['hot']:>10.2f}")
    for part in ("attention_us", "chain_us"):
        print(part, {k: [round(v, 2) for v in vs] for k, vs in result[part].items()})


if __name__ == "__main__":
    main()
