"""GRPO step throughput on N GPUs at the same per-GPU batch (issue 6): does the step scale with N?

    torchrun --nproc_per_node=N bench/gpu_scale.py [--out DIR] [--steps 3]          # on the GPU machine
    PYTHONPATH=. .venv/bin/torchrun --nproc_per_node=2 bench/gpu_scale.py --quick  # CPU (gloo, tiny model)

One process per GPU (torchrun, no Ray: the GPU image has none), one torch.distributed world (nccl; gloo on
CPU). Each rank does what a colocated RL worker (stages/workers/actor_rollout.py) does in one GRPO step:

1. rollout: its own `--prompts` prompts x `--n` samples with the cuda engine (stages/rollout/cuda_engine.py,
   bf16, max_num_seqs = prompts x n, so the whole share runs at once), temperature 1, up to 512 tokens;
2. old logprobs: a no-grad pass of the actor over its sequences;
3. rewards and GRPO advantages (group-normalised; the reward is a cheap function of the response so that
   it costs nothing: this measures the engine and the trainer, not a scorer);
4. actor update: `--minis` mini-batches (each an AdamW step over all ranks' rows), packed micro-batches of
   <= `--micro-tokens` tokens, vanilla PPO clip loss with token-mean over the global denominators
   (summed over ranks, as stages.workers.actor_update.global_denominators does), gradient clipping at 1.0; the actor is the worker's:
   fp32 master weights, TokenLogprobs(pack=True), FSDP2 over the N ranks through stages/model/fsdp.shard
   (per decoder layer + root, bf16 compute, summed gradients);
5. weight sync: the new weights streamed into the engine layer by layer (stages/model/fsdp.iter_hf_weights).

Workload: the GPU benchmarks' Qwen2.5-0.5B shape with random weights (bench/gpu_common.py), the EOS logit
calibrated to a 1/200 per-token hazard (mean response about 180 of 512 tokens), prompts of 128-256 random
tokens, different on every rank. The per-GPU batch is the same at every N, so perfect scaling is N times
the sequences per second. Each phase is timed on every rank between barriers (so a phase's time is the
slowest rank's); the first `--warmup` steps (compilation, graph capture, allocator) are not counted, the
figures are medians over the timed steps. Layers are not torch.compile'd here (its ~90 s warm-up does not
fit a device lease; the packed uncompiled update is what bench/results/2026-11-22-gpu-train.md calls
`packed`). Rank 0 writes gpu-scale-n{N}.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import Results, calibrate_eos, machine, num_params, peak_gib, reset_peak  # noqa: E402
from bench.gpu_common import workload_model, workload_prompts  # noqa: E402
from stages.batch import Batch, build_batch  # noqa: E402
from stages.core import POLICY_LOSSES, grpo_advantages, loss_denominators  # noqa: E402
from stages.model.fsdp import iter_hf_weights, shard  # noqa: E402
from stages.model.policy import TokenLogprobs  # noqa: E402
from stages.rollout.base import SamplingParams  # noqa: E402
from stages.rollout.cuda_engine import CudaRolloutEngine  # noqa: E402

PHASES = ("rollout", "old_logprob", "update", "sync")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model on CPU (gloo): a smoke test of the whole step")
    p.add_argument("--out", default=None, help="folder for gpu-scale-n{N}.json (default $OUT or bench/results/raw)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per GPU (default 32; 2 with --quick)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default 8; 4 with --quick)")
    p.add_argument("--max-tokens", type=int, default=None, help="response cap (default 512; 24 with --quick)")
    p.add_argument("--steps", type=int, default=3, help="timed GRPO steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed GRPO steps first")
    p.add_argument("--minis", type=int, default=2, help="mini-batches (optimizer steps) per GRPO step")
    p.add_argument("--micro-tokens", type=int, default=16384, help="packed micro-batch size in tokens")
    args = p.parse_args(argv)
    q = args.quick
    args.prompts = args.prompts or (2 if q else 32)
    args.n = args.n or (4 if q else 8)
    args.max_tokens = args.max_tokens or (24 if q else 512)
    for name in ("prompts", "n", "max_tokens", "steps", "minis", "micro_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.prompts % args.minis:
        p.error(f"--prompts={args.prompts} must be a multiple of --minis={args.minis} (whole groups per mini-batch)")
    return args


def setup() -> tuple[int, int, str]:
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc_per_node=N bench/gpu_scale.py ...")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        return rank, world, "cuda"
    dist.init_process_group("gloo")
    return rank, world, "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def micro_groups(batch: Batch, max_tokens: int, device: str) -> list[list[int]]:
    """Contiguous micro-batches of about equal tokens, as many on every rank (FSDP2's collectives must pair
    up across ranks): the most any rank needs for <= max_tokens each."""
    lengths = batch.tensors["attention_mask"].sum(-1)
    count = torch.tensor(-(-int(lengths.sum()) // max_tokens), device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    k = min(int(count), len(lengths))
    ends = torch.cumsum(lengths, 0).double()
    cut = torch.searchsorted(ends, ends[-1] * torch.arange(1, k, dtype=torch.float64) / k, right=False).tolist()
    bounds = sorted({0, *[min(c + 1, len(lengths) - 1) for c in cut], len(lengths)})
    while len(bounds) - 1 < k:  # ties collapsed a boundary: split the largest group
        i = max(range(len(bounds) - 1), key=lambda j: bounds[j + 1] - bounds[j])
        bounds.insert(i + 1, (bounds[i] + bounds[i + 1]) // 2)
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def to_device(tensors: dict, device: str) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in tensors.items()}


def reward(response: list[int]) -> float:
    return (len(response) % 7) / 6  # cheap and varied within a group (GRPO needs a spread)


class Step:
    def __init__(self, args, rank: int, world: int, device: str):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        model = workload_model(args.quick, device, torch.float32)  # same seed on every rank: same weights
        self.eos_info = calibrate_eos(model, hazard=1 / 200)
        self.config = model.config
        self.params = num_params(model)
        max_len = (16 if args.quick else 256) + args.max_tokens
        self.engine = CudaRolloutEngine(model, self.config.eos_token_id, max_num_seqs=args.prompts * args.n,
                                        max_model_len=max_len, dtype=torch.bfloat16 if device == "cuda" else None)
        self.actor = shard(TokenLogprobs(model, chunk_tokens=8192, pack=True),
                           torch.bfloat16 if device == "cuda" else None)
        self.optimizer = torch.optim.AdamW(self.actor.parameters(), lr=1e-6, fused=device == "cuda")
        self.step_index = 0

    def prompts(self) -> list[list[int]]:
        lo, hi = (8, 16) if self.args.quick else (128, 256)
        seed = 1000 * self.step_index + self.rank  # different prompts on every rank and step
        return workload_prompts(self.args.prompts, lo, hi, self.config.vocab_size, self.config.eos_token_id, seed)

    def run(self) -> dict:
        a, times, info = self.args, {}, {}
        prompts = self.prompts()
        params = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens,
                                stop_token_ids=(self.config.eos_token_id,), seed=self.step_index * 100 + self.rank)
        sync()
        t0 = time.perf_counter()
        self.engine.wake()
        outs = self.engine.generate(prompts, params)
        self.engine.sleep()
        sync()
        times["rollout"] = time.perf_counter() - t0
        outs = sorted(outs, key=lambda o: o.prompt_index)
        batch = build_batch([prompts[o.prompt_index] for o in outs], [o.response_ids for o in outs],
                            [o.logprobs for o in outs], pad_token_id=self.config.pad_token_id)
        mask = batch.response_mask
        info["sequences"] = len(outs)
        info["response_tokens"] = int(mask.sum())
        info["tokens"] = int(batch.tensors["attention_mask"].sum())

        t0 = time.perf_counter()
        self.actor.eval()
        old = torch.zeros(mask.shape)
        with torch.no_grad():
            for rows in micro_groups(batch, a.micro_tokens, self.device):
                lp, _ = self.actor(**to_device(batch.select(rows).model_inputs(), self.device), temperature=1.0)
                old[rows] = lp.float().cpu()
        sync()
        times["old_logprob"] = time.perf_counter() - t0
        info["rollout_vs_trainer_logprob_mean"] = float(((old - batch.tensors["rollout_logprobs"]).abs() * mask).sum()
                                                        / mask.sum())
        batch.tensors["old_logprobs"] = old

        t0 = time.perf_counter()
        scores = torch.zeros(mask.shape)
        last = mask.sum(-1) - 1
        scores[torch.arange(len(outs)), last] = torch.tensor([reward(o.response_ids) for o in outs])
        index = [o.prompt_index for o in outs]
        batch.tensors["advantages"], _ = grpo_advantages(scores, mask, index)
        metrics = self.update(batch)
        sync()
        times["update"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        self.engine.wake()
        self.engine.update_weights(iter_hf_weights(self.actor, None))
        self.engine.sleep()
        sync()
        times["sync"] = time.perf_counter() - t0
        times["step"] = sum(times[p] for p in PHASES)
        self.step_index += 1
        return {**times, **info, **metrics}

    def update(self, batch: Batch) -> dict:
        a = self.args
        self.actor.train()
        rows_per_mini = len(batch) // a.minis
        losses, norms = [], []
        for start in range(0, len(batch), rows_per_mini):
            mini = batch.select(list(range(start, start + rows_per_mini)))
            denominators = global_denominators(mini.response_mask, self.device)
            for rows in micro_groups(mini, a.micro_tokens, self.device):
                micro = mini.select(rows)
                t = to_device(micro.tensors, self.device)
                logprobs, _ = self.actor(**to_device(micro.model_inputs(), self.device), temperature=1.0,
                                         with_entropy=True, entropy_grad=False)
                loss, _ = POLICY_LOSSES.get("vanilla")(
                    t["old_logprobs"], logprobs, t["advantages"], t["response_mask"], "token-mean",
                    clip_ratio_low=0.2, clip_ratio_high=0.2, **denominators, max_response_length=a.max_tokens)
                loss.backward()
                losses.append(loss.detach())
            norms.append(grad_norm(self.actor, 1.0))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return {"loss_sum": float(torch.stack(losses).sum()), "grad_norm_max": max(norms)}


def global_denominators(response_mask: torch.Tensor, device: str) -> dict:
    """The mini-batch's loss denominators summed over ranks (the worker's global_denominators, without its
    config imports: the GPU image has no pydantic)."""
    out = {}
    for k, v in loss_denominators(response_mask).items():
        v = v.to(device)
        dist.all_reduce(v)
        out[k] = v
    return out


def grad_norm(module: torch.nn.Module, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(list(module.parameters()), max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def gather_max(values: dict) -> dict:
    """Per-rank figures -> {name: max over ranks} for times, {name: sum over ranks} for counts."""
    out = {}
    for k, v in values.items():
        t = torch.tensor(float(v), dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
        summed = k in ("sequences", "response_tokens", "tokens")
        dist.all_reduce(t, op=dist.ReduceOp.SUM if summed else dist.ReduceOp.MAX)
        out[k] = int(t.item()) if summed else t.item()
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world, device = setup()
    res = Results(f"gpu-scale-n{world}", args.out) if rank == 0 else None
    if res:
        res.add("machine", {**machine(), "world_size": world, "backend": dist.get_backend(),
                            "gpus": torch.cuda.device_count() if device == "cuda" else 0})
        res.add("config", {k: v for k, v in vars(args).items() if k != "out"})
    t0 = time.perf_counter()
    step = Step(args, rank, world, device)
    sync()
    if res:
        res.add("setup", {"setup_s": time.perf_counter() - t0, "params": step.params, **step.eos_info})
    timed = []
    for i in range(args.warmup + args.steps):
        reset_peak()
        figures = gather_max(step.run())
        figures["peak_gib"] = gather_max({"peak_gib": peak_gib()})["peak_gib"]
        if i >= args.warmup:
            timed.append(figures)
        if res:
            res.add(f"step{i}" + ("_warmup" if i < args.warmup else ""), figures)
    if res:
        med = {k: statistics.median(f[k] for f in timed) for k in (*PHASES, "step", "sequences", "tokens",
                                                                   "response_tokens")}
        summary = {**{f"{p}_s": med[p] for p in PHASES}, "step_s": med["step"],
                   "sequences_per_step": med["sequences"], "seq_per_s": med["sequences"] / med["step"],
                   "tok_per_s": med["tokens"] / med["step"],
                   "response_tok_per_s": med["response_tokens"] / med["step"],
                   "rollout_response_tok_per_s": med["response_tokens"] / med["rollout"]}
        res.add("summary", summary)
        res.table([(f"N={world}: step s", summary["step_s"], "median of timed steps"),
                   *[(f"N={world}: {p} s", summary[f"{p}_s"], "slowest rank") for p in PHASES],
                   (f"N={world}: sequences/s", summary["seq_per_s"], f"{med['sequences']} sequences per step"),
                   (f"N={world}: tokens/s (prompt + response)", summary["tok_per_s"], "")])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
