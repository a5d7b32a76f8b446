"""Do the decode step's matmuls run faster with their weights in L2? (0.5B shape, M = 256)

    python3 bench/gpu_decode_l2.py --out $OUT        # on the GPU machine; writes gpu-decode-l2.json

Each of a layer's four projections through F.linear at M = 256, cold (a CUDA graph over 24 copies of the weight:
every call reads it from HBM, as in the step) and hot (24 calls on one copy: from L2 after the first), and cold
with the operands swapped (W @ x.T, the output transposed); median of 5 replays, us per call. The attention kernel
that prefetched the weights into L2 during the step, measured with this bench and not kept, is at commit cc6b4ae
(bench/results/2026-11-28-gpu-decode-l2-persistent-layout.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import graph_seconds, machine  # noqa: E402

B, HEADS, KV_HEADS, D, HIDDEN, INTER, LAYERS = 256, 14, 2, 64, 896, 4864, 24


def per_call_us(fns) -> float:
    """Microseconds per call over one CUDA graph that calls each of fns once."""
    return graph_seconds(lambda: [fn() for fn in fns]) / len(fns) * 1e6


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
        cold = per_call_us([lambda a=a, w=w: F.linear(a, w) for w in ws])
        hot = per_call_us([lambda a=a, w=ws[0]: F.linear(a, w) for _ in ws])
        # swap AB: (W @ x.T).T, the large dimension on the tiles' long side (cuBLAS picks other kernels)
        swapped = per_call_us([lambda a=a, w=w: torch.mm(w, a.t()) for w in ws])
        result["matmul_us"][name] = {"cold": cold, "hot": hot, "cold_swap_ab": swapped}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-decode-l2.json").write_text(json.dumps(result, indent=1))
    print(f"{'matmul':<10}{'cold us':>10}{'hot us':>10}{'swap AB':>10}")
    for name, r in result["matmul_us"].items():
        print(f"{name:<10}{r['cold']:>10.2f}{r['hot']:>10.2f}{r['cold_swap_ab']:>10.2f}")


if __name__ == "__main__":
    main()
