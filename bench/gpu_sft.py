"""SFT step speed on one GPU: stages/sft.py's `train_step` as run_sft runs it (fp32 master weights, bf16 autocast).

    python3 bench/gpu_sft.py --out $OUT --name NAME [--shape 0.5b]      # in a checkout (or an older one: same API)
    python3 bench/gpu_sft.py --out $OUT --name NAME --shape 3b --offload   # sft.offload: FSDP2 CPU offload, as run_sft
    ... --adamw default                    # torch's own AdamW choice instead of the pipeline's (A/B of the fused step)

Workload: a Qwen2.5-shaped model with random weights, 64 examples per optimizer step in micro-batches of 8,
prompts of 128-256 tokens and responses of 100-512 (uniform), AdamW as the pipeline builds it. Figures: median
of the timed steps after warm-up (the first step compiles): seconds, tokens/s (prompt + response), MFU = 6 x params
x tokens / seconds / the run's measured bf16 matmul rate (as bench/gpu_worker.py), peak memory.
Works with the code before SFT went through TokenLogprobs (train_step took the model itself).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import Results, machine, measure_ceilings, num_params, workload_model, workload_prompts  # noqa: E402
from stages import sft  # noqa: E402
from stages.model.optim import fused_adamw  # noqa: E402

try:
    from stages.sft_data import SFTExample  # noqa: E402
except ModuleNotFoundError:  # an older checkout: SFTExample was in stages/sft.py
    SFTExample = sft.SFTExample


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="gpu-sft")
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--offload", action="store_true", help="sft.offload: weights, gradients, AdamW in host memory")
    p.add_argument("--adamw", default="auto", choices=["auto", "fused", "default"],
                   help="auto: as the pipeline chooses (stages/model/optim.py); default: torch's choice (fused=None)")
    args = p.parse_args()
    res = Results(args.name, args.out)
    ceilings = measure_ceilings()
    res.add("machine", {**machine(), **ceilings})
    model = workload_model(False, "cpu" if args.offload else "cuda", torch.float32, shape=args.shape).train()
    vocab, eos = model.config.vocab_size, model.config.eos_token_id
    prompts = workload_prompts(args.batch, 128, 256, vocab, eos, seed=1)
    responses = workload_prompts(args.batch, 100, 512, vocab, eos, seed=2)
    examples = [SFTExample(p_ + r + [eos], len(p_)) for p_, r in zip(prompts, responses)]
    tokens = sum(len(e.input_ids) for e in examples)
    trained = sft.sft_policy(model, cuda=True) if hasattr(sft, "sft_policy") else model
    if args.offload:  # as run_sft with sft.offload: a world of one, FSDP2 with CPU offload and bf16 compute
        from stages.model.fsdp import init_process_group, shard

        init_process_group()
        trained = shard(trained, param_dtype=torch.bfloat16, offload=True)
    fused = {"auto": fused_adamw(list(trained.parameters())), "fused": True, "default": None}[args.adamw]
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-6, fused=fused)
    res.add("optimizer", {"adamw": args.adamw, "fused": fused})
    device = {"device": torch.device("cuda")} if args.offload else {}
    optimizer_s = []  # the optimizer step's share (with sft.offload it runs on the CPU)
    step_fn = optimizer.step

    def timed_step(*a, **k):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        out = step_fn(*a, **k)
        torch.cuda.synchronize()
        optimizer_s.append(time.perf_counter() - begin)
        return out

    optimizer.step = timed_step
    times = []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not args.offload):
            loss, _ = sft.train_step(trained, optimizer, examples, args.micro, 1.0, pad_id=0, **device)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30
        res.add(f"step{step}", {"seconds": seconds, "loss": float(loss), "peak_gib": peak,
                                "optimizer_s": optimizer_s[-1]})
        if step >= args.warmup:
            times.append(seconds)
    median = sorted(times)[len(times) // 2]
    mfu = 6 * num_params(model) * tokens / median / (ceilings["bf16_matmul_tflops"] * 1e12)
    host_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    res.add("summary", {"step_s": median, "tokens_per_step": tokens, "tok_per_s": tokens / median, "mfu": mfu,
                        "params": num_params(model), "path": "sft_policy" if trained is not model else "model",
                        "offload": args.offload, "host_peak_rss_gib": host_gib})
    res.table([("step s", median, f"{tokens} tokens"), ("tokens/s", tokens / median, ""), ("MFU", mfu, ""),
               ("peak GiB", peak, "last step")])


if __name__ == "__main__":
    main()
