"""The engine's decode step as one batch against the same batch cut into parts that run on their own streams.

    python3 bench/gpu_decode_streams.py --out $OUT       # on the GPU machine; writes gpu-decode-streams.json

Every kernel of the 0.5B step at 256 sequences costs a few microseconds however little it reads (launch, first
loads, tail: bench/results/2026-11-25-gpu-decode-gemm-and-pdl.md). Parts of the batch are independent from the
embedding to the logits, so a CUDA graph can hold them as parallel branches: one part's latency-bound kernels may
then overlap another's. The price: each part reads the weights again (from L2 when the parts run close together).
The engine's own decoder (compiled functions, Triton attention) runs each part on its slots' share of the cache.
(Session 9 ran the same idea as an engine option, reverted: bench/results/2026-11-25-gpu-decode-row-groups.md.)
`--batches` times the decode of the first b slots alone: the part of the step that does not depend on the batch.
Median of 5 replays of one CUDA graph per variant, in alternating order, three rounds; positions uniform in
[128, 704) as the engine's step figure.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import (  # noqa: E402
    capture_graph,
    graph_seconds,
    machine,
    measure_ceilings,
    profile_kernels,
    workload_model,
)
from stages.rollout.cuda_engine import CudaRolloutEngine  # noqa: E402

B, LOW, HIGH, MAX_LEN = 256, 128, 704, 768


def part_decoders(decoder, parts: int) -> list:
    """Views of the decoder, each on its share of the slots (same weights, compiled functions and kernels)."""
    size, views = B // parts, []
    for p in range(parts):
        view = copy.copy(decoder)
        view.kv = decoder.kv[:, :, p * size:(p + 1) * size]
        views.append(view)
    return views


def run_parts(views, ids, positions, streams) -> list[torch.Tensor]:
    """Each part's decode on its own stream (or all on the current one when streams is None)."""
    size, outs = B // len(views), []
    main = torch.cuda.current_stream()
    for p, view in enumerate(views):
        stream = streams[p] if streams else main
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            sl = slice(p * size, (p + 1) * size)
            outs.append(view.decode(ids[sl], positions[sl], MAX_LEN))
    for stream in streams or []:
        main.wait_stream(stream)
    return outs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--parts", type=int, nargs="*", default=[2, 4])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64, 128],
                   help="also the decode of the first b slots alone (the step's cost against its batch)")
    p.add_argument("--profile", type=int, nargs="*", default=[], metavar="B",
                   help="kernel tables of replays of the decode graph at these batch sizes (profile-bB.txt)")
    args = p.parse_args()
    model = workload_model(False, "cuda")
    engine = CudaRolloutEngine(model, model.config.eos_token_id, max_num_seqs=B, max_model_len=MAX_LEN)
    del model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    positions = torch.randint(LOW, HIGH, (B,), device="cuda", generator=g)
    ids = torch.randint(0, 1000, (B,), device="cuda", generator=g)
    decoder = engine.decoder
    variants = {"one_batch": lambda: [decoder.decode(ids, positions, MAX_LEN)]}
    for parts in args.parts:
        views = part_decoders(decoder, parts)
        streams = [torch.cuda.Stream() for _ in range(parts)]
        variants[f"{parts}_parts_one_stream"] = lambda v=views: run_parts(v, ids, positions, None)
        variants[f"{parts}_parts_{parts}_streams"] = lambda v=views, s=streams: run_parts(v, ids, positions, s)
    for b in args.batches:
        variants[f"batch_{b}"] = lambda b=b: [decoder.decode(ids[:b], positions[:b], MAX_LEN)]
    reference = torch.cat(variants["one_batch"]()).float()
    result = {"machine": machine(), "ceilings": measure_ceilings(), "agreement": {}, "us": {k: [] for k in variants}}
    for name, fn in variants.items():
        if name.startswith("batch_"):  # fewer rows than the reference: nothing to compare
            continue
        logits = torch.cat(fn()).float()
        result["agreement"][name] = {
            "max_abs_diff": (logits - reference).abs().max().item(), "max_abs": reference.abs().max().item(),
            "argmax_equal_frac": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()}
    for _ in range(3):
        for name, fn in variants.items():
            result["us"][name].append(graph_seconds(fn) * 1e6)
    for b in args.profile:
        graph = capture_graph(lambda b=b: decoder.decode(ids[:b], positions[:b], MAX_LEN))
        profile_kernels(lambda g=graph: [g.replay() for _ in range(10)], out / f"profile-b{b}.txt", rows=60)
    result["median_us"] = {k: statistics.median(v) for k, v in result["us"].items()}
    (out / "gpu-decode-streams.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
