"""The decode attention kernel over two K/V cache layouts (0.5B shape, 256 sequences, 24 layers).

    python3 bench/gpu_decode_layout.py --out $OUT        # on the GPU machine; writes gpu-decode-layout.json

The engine's cache is (slot, position, kv head, dim): a (sequence, kv head) program reads 128-byte rows 256 bytes
apart. Head-major, (slot, kv head, position, dim), gives each program one contiguous run of its positions. The
kernel takes strides, so the same `decode_step_attention` (rotation, K/V write, attention) runs on both; positions
uniform in [128, 704) as the engine's step figure. Median of 5 replays of one CUDA graph, us per layer, in
alternating order.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import graph_seconds, machine  # noqa: E402
from stages.rollout.triton_kernels import decode_step_attention  # noqa: E402

B, T, HEADS, KV_HEADS, D, LAYERS = 256, 768, 14, 2, 64, 24


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    positions = torch.randint(128, 704, (B,), device="cuda", generator=g)
    lengths = (positions + 1).to(torch.int32)
    angles = torch.arange(T, device="cuda")[:, None] * torch.rand(D // 2, device="cuda", generator=g).repeat(2)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    qkv = torch.randn(B, (HEADS + 2 * KV_HEADS) * D, device="cuda", generator=g).bfloat16()
    engine = [torch.randn(2, B, T, KV_HEADS, D, device="cuda", generator=g).bfloat16() for _ in range(LAYERS)]
    head_major = [c.transpose(2, 3).contiguous().transpose(2, 3) for c in engine]  # same values, other strides

    def step(caches):
        return [decode_step_attention(qkv, cos, sin, positions, lengths, HEADS, c[0], c[1], D ** -0.5)
                for c in caches]

    same = all(torch.equal(a, b) for a, b in zip(step(engine), step(head_major)))
    result = {"machine": machine(), "outputs_equal": same, "engine_layout_us": [], "head_major_us": []}
    for _ in range(3):
        result["engine_layout_us"].append(graph_seconds(lambda: step(engine)) / LAYERS * 1e6)
        result["head_major_us"].append(graph_seconds(lambda: step(head_major)) / LAYERS * 1e6)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-decode-layout.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}))


if __name__ == "__main__":
    main()
