"""Does a decode step in row groups run its groups side by side? Kernel traces of the captured step (H100).

    python bench/gpu_decode_groups.py --out $OUT [--groups 1 2 3]      # on the GPU machine
    PYTHONPATH=. .venv/bin/python bench/gpu_decode_groups.py --quick   # CPU smoke test (timings only)

The engine's `decode_groups` cuts the step's rows into groups, each run on its own CUDA stream inside the
captured graph (stages/rollout/cuda_model.py `Decoder.decode`). For each group count this builds the 0.5B engine
of bench/gpu_rollout.py, fills every slot at positions as in that bench, times the full-batch graph, then
profiles a few replays and reads the kernel trace: device busy time (the union of kernel intervals), the sum of
kernel times (their ratio: how many kernels ran at once on average), time per stream, and the heaviest kernels
with their grids (a kernel whose grid covers every SM leaves no room for another stream's kernels).
Writes gpu-decode-groups.json (and the chrome traces) under --out and prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import Results, cuda_time, machine, workload_model  # noqa: E402
from bench.gpu_rollout import fill_slots  # noqa: E402
from stages.rollout.cuda_engine import CudaRolloutEngine  # noqa: E402
from stages.rollout.sampling import SamplingMode  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="tiny model on CPU: eager steps, no trace")
    p.add_argument("--out", default=None)
    p.add_argument("--groups", nargs="*", type=int, default=[1, 2, 3])
    p.add_argument("--rows", type=int, default=256)
    return p.parse_args()


def trace_summary(path: Path, replays: int) -> dict:
    """Kernels of a chrome trace: busy (union) and summed time per replay, per-stream time, heaviest kernels."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    per_stream, per_kernel = defaultdict(float), defaultdict(lambda: [0.0, 0, None])
    for e in events:
        per_stream[str(e["args"].get("stream"))] += e["dur"] / replays
        k = per_kernel[e["name"][:80]]
        k[0] += e["dur"] / replays
        k[1] += 1
        k[2] = e["args"].get("grid")
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:12]
    total = sum(e["dur"] for e in events)
    return {"kernels_per_step": len(events) / replays, "busy_us": busy / replays, "kernel_sum_us": total / replays,
            "concurrency": total / busy if busy else 0.0, "per_stream_us": dict(per_stream),
            "top": [{"name": n, "us": us, "calls": c // replays, "grid": g} for n, (us, c, g) in top]}


def measure(res: Results, model, groups: int, rows: int, quick: bool) -> None:
    c = model.config
    engine = CudaRolloutEngine(model, c.eos_token_id, max_num_seqs=rows, max_model_len=(16 if quick else 256) + 512,
                               decode_groups=groups)
    mode, low, high = SamplingMode(False), (8 if quick else 128), (24 if quick else 704)
    fill_slots(engine, low, high)
    label = f"groups_{groups}"
    if quick:
        start = time.perf_counter()
        engine._decode_step(rows, engine.decoder.max_len, mode)  # the eager step runs (no graphs off CUDA)
        res.add(label, {"step_ms": (time.perf_counter() - start) * 1e3})
        return
    graph = engine._graph(rows, engine.decoder.max_len, mode)
    step = cuda_time(lambda: [graph.replay() for _ in range(10)], warmup=1, repeat=5) / 10
    res.add(label, {"step_ms": step * 1e3})
    fill_slots(engine, low, high)  # each replay moves every slot one position on: back below the cache's end
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    path = res.out / f"trace-{label}.json"
    prof.export_chrome_trace(str(path))
    res.add(label, trace_summary(path, 3))


def main() -> None:
    args = parse_args()
    res = Results("gpu-decode-groups", args.out)
    res.add("machine", machine())
    device = "cpu" if args.quick else "cuda"
    model = workload_model(args.quick, device, torch.float32 if args.quick else torch.bfloat16)
    rows = 8 if args.quick else args.rows
    for groups in args.groups:
        res.attempt(f"groups_{groups}", measure, res, model, groups, rows, args.quick)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    table = []
    for groups in args.groups:
        d = res.data.get(f"groups_{groups}", {})
        table.append((f"groups {groups}: step ms | busy us | kernel sum us | kernels at once",
                      f"{d.get('step_ms', 0):.3f} | {d.get('busy_us', 0):,.0f} | {d.get('kernel_sum_us', 0):,.0f} | "
                      f"{d.get('concurrency', 0):.2f}", d.get("error", "")))
    res.table(table)


if __name__ == "__main__":
    main()
