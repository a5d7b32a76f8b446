"""AdamW's step on host memory: torch's default loop against the fused kernel (what offloaded FSDP2 shards use).

    PYTHONPATH=. .venv/bin/python bench/cpu_adamw.py [--millions 320] [--tensors 100] [--out DIR]

sft.offload and rl.actor.param_offload keep fp32 weights, gradients and AdamW moments in host memory, where the
optimizer step runs; stages/model/optim.py `build_optimizer` picks the fused kernel for them. This times one step
(median of 3 after one) of each implementation on plain tensors and on FSDP2 shards (a world of this process), and
checks the fused step's weights against the loop's. Prints a table; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.model.fsdp import init_process_group  # noqa: E402

KINDS = {"loop (torch's default on CPU)": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def step_seconds(model: torch.nn.Module, options: dict) -> tuple[float, list[torch.Tensor]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, **options)
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 1e-3
    optimizer.step()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    weights = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]
    return statistics.median(times), weights


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--millions", type=float, default=320.0, help="parameters in all, millions")
    p.add_argument("--tensors", type=int, default=100)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    init_process_group()
    width = 1024
    rows = max(1, int(args.millions * 1e6 / args.tensors / width))
    torch.manual_seed(0)
    base = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(rows, width)) for _ in range(args.tensors)])
    results, reference = {}, None
    for layout in ("plain", "fsdp2"):
        for name, options in KINDS.items():
            model = copy.deepcopy(base)
            if layout == "fsdp2":
                fully_shard(model)
            seconds, weights = step_seconds(model, options)
            if reference is None:
                reference = weights
            gap = max((a - b).abs().max().item() for a, b in zip(reference, weights))
            results[f"{layout}: {name}"] = {"s": seconds, "max_abs_diff_to_first": gap}
    dist.destroy_process_group()
    loop = results["plain: loop (torch's default on CPU)"]["s"]
    print(f"{args.millions:.0f}M fp32 parameters in {args.tensors} tensors, {torch.get_num_threads()} threads")
    for key, r in results.items():
        print(f"{key:45s} {r['s']:8.3f} s  x{loop / r['s']:.2f}  max |w - loop's| {r['max_abs_diff_to_first']:.1e}")
    record = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")},
              "params_millions": args.millions, "tensors": args.tensors, "results": results}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cpu-adamw.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
