"""Tensor- against data-parallel rollout with the cuda engine over the GPUs of one machine (issue 18).

    torchrun --nproc_per_node=N bench/gpu_tp_rollout.py --out $OUT --tp K [--shape 7b]
    torchrun --nproc_per_node=1 bench/gpu_tp_rollout.py --out $OUT --tp 1 --group-of-one    # one GPU: the
        engine's all-reduce over a group of one rank, captured in its CUDA graphs (what tp > 1 runs)
    torchrun --nproc_per_node=2 bench/gpu_tp_rollout.py --quick --tp 2 --out DIR            # CPU, gloo, tiny

N ranks form N/K engines of K consecutive ranks (K = 1: data parallel, every GPU its own engine). Workload as
bench/gpu_rollout.py (Qwen2.5 shape, random bf16 weights, calibrated EOS, prompts of 128-256 tokens, T = 1), 32
prompts x 8 samples per GPU, so 256 sequences per GPU in flight in every layout (an engine of K ranks holds 256 K).
Every engine generates its share of the prompts; the ranks of an engine in lockstep. Measured: generated tokens/s
over all engines (wall time of the slowest, best of --repeats after a first call with compilation and capture),
one engine's decode step at full batch (graph replays), peak memory per GPU; rank 0 writes gpu-tp-rollout.json
under --out and prints a short table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import (  # noqa: E402
    Results,
    calibrate_eos,
    machine,
    num_params,
    peak_gib,
    reset_peak,
    workload_model,
    workload_prompts,
)
from bench.gpu_rollout import decode_step_seconds, lengths_summary  # noqa: E402
from stages.batch import rank_rows  # noqa: E402
from stages.model.sequence_parallel import consecutive_group  # noqa: E402
from stages.rollout.base import SamplingParams  # noqa: E402
from stages.rollout.cuda_engine import CudaRolloutEngine  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--tp", type=int, default=1, help="ranks per engine (tensor parallel size)")
    p.add_argument("--shape", default="0.5b", choices=["0.5b", "1.5b", "3b", "7b"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="CPU (gloo), tiny model and workload")
    p.add_argument("--group-of-one", action="store_true", help="with --tp 1 on one rank: a process group anyway")
    return p.parse_args()


def setup(quick: bool) -> tuple[int, int, str]:
    backend = "gloo" if quick else "nccl"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if quick:
        return rank, world, "cpu"
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    return rank, world, f"cuda:{local}"


def timed(engine, prompts, params, device: str) -> tuple[list, float]:
    if device != "cpu":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    if device != "cpu":
        torch.cuda.synchronize()
    dist.barrier()
    return outs, time.perf_counter() - start


def main() -> None:
    args = parse_args()
    rank, world, device = setup(args.quick)
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the number of ranks, {world}")
    engines, engine_id = world // args.tp, rank // args.tp
    group = consecutive_group(args.tp, "--tp")
    if group is None and args.group_of_one:
        group = dist.new_group([rank]) if world == 1 else None
    res = Results("gpu-tp-rollout", args.out) if rank == 0 else None
    model = workload_model(args.quick, device, torch.float32 if args.quick else torch.bfloat16, shape=args.shape)
    config = model.config
    workload = {"params": num_params(model), **calibrate_eos(model, hazard=1 / 200)}  # same weights on every rank
    per_gpu, n, max_tokens, lo, hi = (2, 4, 32, 8, 16) if args.quick else (32, 8, 512, 128, 256)
    prompts = workload_prompts(per_gpu * world, lo, hi, config.vocab_size, config.eos_token_id)
    share = [prompts[i] for i in rank_rows(len(prompts), engines, len(prompts))[engine_id]]
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=1_000_003 * engine_id)
    concurrency = per_gpu * n * args.tp
    reset_peak()
    engine = CudaRolloutEngine(model, config.eos_token_id, max_num_seqs=concurrency, max_model_len=hi + max_tokens,
                               tensor_parallel_group=group)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    _, first = timed(engine, share, params, device)
    runs = []
    for _ in range(args.repeats):
        outs, seconds = timed(engine, share, params, device)
        tokens = torch.tensor([sum(len(o.response_ids) for o in outs) if rank % args.tp == 0 else 0],
                              dtype=torch.float64, device=device)
        dist.all_reduce(tokens)  # each engine's tokens once (its first rank's)
        runs.append((float(tokens.item()) / seconds, seconds))
    step = decode_step_seconds(engine, lo, hi + max_tokens - 64) if device != "cpu" else {}
    peak = torch.tensor([peak_gib() if device != "cpu" else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if res is not None:
        best = max(runs)
        res.add("machine", {**machine(), "ranks": world, "tp": args.tp, "engines": engines})
        res.add("workload", {**workload, "shape": args.shape, "prompts": len(prompts), "n": n,
                             "max_tokens": max_tokens, "sequences_per_engine": concurrency})
        res.add("engine", {"first_call_s": first, "params_per_rank": engine.param_count(),
                           **{f"run{i}_tok_s": t for i, (t, _) in enumerate(runs)}, "best_tok_s": best[0],
                           "best_s": best[1], "peak_gib_max_rank": float(peak.item()), **step,
                           **lengths_summary(outs, max_tokens)})
        res.table([(f"generated tok/s, {world} ranks as {engines} engine(s) of tp {args.tp} (best run)", best[0], ""),
                   ("  decode step ms (one engine, full batch)", step.get("step_ms", "-"), ""),
                   ("  peak GiB (max over ranks)", float(peak.item()), ""),
                   ("  params per rank", engine.param_count(), "")])
    del engine  # its CUDA graphs hold the group's all-reduces: freed before the group goes
    if device != "cpu":
        torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
