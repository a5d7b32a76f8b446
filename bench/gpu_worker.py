"""A whole GRPO step through the RL stage's worker on N GPUs, timed per phase (issues 5 and 6).

    torchrun --nproc_per_node=N bench/gpu_worker.py [--prompts 32] [--out DIR] [--set rl.actor.X=Y ...]
    PYTHONPATH=. .venv/bin/torchrun --nproc_per_node=2 bench/gpu_worker.py --quick    # CPU smoke test (gloo)

Each process is what one Ray worker of the RL stage is: it sees one GPU (CUDA_VISIBLE_DEVICES = its local
rank, as Ray sets it) and holds an `ActorRolloutWorker` (stages/workers/actor_rollout.py) built from a
`Config` of the recipe below plus `--set` overrides, so the worker's own defaults (packing, compiled layers,
FSDP2 settings, fp32 master weights with bf16 compute, fused AdamW) are what is measured. Ray is not on the
GPU image, so the driver's part of stages/rl.py `train_step` is done here by every rank alike, in the stage's
order and with its helpers:

    gen            each rank's engine samples its own prompts (`rl.rollout.engine=cuda`, the default here);
                   the driver gathers them, scores them (a cheap reward of the length: this measures the
                   engine and the trainer, not a scorer) and `balance_batch`es the global batch
    old_log_prob   `compute_logprobs` on each rank's rows (`rank_rows`: its share of every mini-batch)
    adv            GRPO advantages on the global batch (stages.core)
    update_actor   `update_actor` on each rank's rows (ppo_mini_batch_size prompts per optimizer step)
    sync           `sync_weights`: layer-by-layer streaming into the engine, then the engine's greedy
                   tokens checked against the trainer (rl.rollout.logprob_check_tokens; when
                   rl.rollout.logprob_check_freq says, as in the stage: the first, every k-th, the last)

Workload per GPU (issue 5's, split by `--prompts`): Qwen2.5-0.5B shape with random weights, the EOS logit
calibrated to a 1/200 per-token hazard (bench/gpu_common.py), prompts of 128-256 random tokens, n=8,
temperature 1, up to 512 response tokens. The per-GPU batch is the same at every N (N x --prompts prompts
per step), so perfect scaling is N times the sequences per second. Phases end with a barrier (a phase takes
its slowest rank's time, as the driver waits for every rank); the first `--warmup` steps (compilation, graph
capture) are not counted; phase times are medians over the timed steps, rates totals over them. Rank 0
writes gpu-worker-n{N}.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("gen", "old_log_prob", "adv", "update_actor", "sync")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model on CPU (gloo): a smoke test of the whole step")
    p.add_argument("--out", default=None, help="folder for gpu-worker-n{N}.json (default $OUT or bench/results/raw)")
    p.add_argument("--name", default="gpu-worker", help="results file name prefix")
    p.add_argument("--prompts", type=int, default=None, help="prompts per GPU and step (default 32; 2 with --quick)")
    p.add_argument("--minis", type=int, default=2, help="optimizer steps per GRPO step (mini-batches)")
    p.add_argument("--steps", type=int, default=3, help="timed GRPO steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed GRPO steps first")
    p.add_argument("--profile", nargs="?", const="update_actor", default=None, choices=["update_actor", "sync"],
                   help="one more step with this phase (default update_actor) under torch.profiler "
                        "(profile-NAME-nN.txt)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides (after the recipe)")
    p.add_argument("--shape", default="0.5b", choices=["0.5b", "1.5b", "3b", "7b"],
                   help="Qwen2.5 shape (random weights)")
    p.add_argument("--hazard", type=float, default=1 / 200,
                   help="per-token EOS probability the model is calibrated to (mean response ~1/hazard tokens)")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="prompt lengths drawn from LO..HI (default 128 256; 8 16 with --quick)")
    p.add_argument("--response-tokens", type=int, default=None, help="max response tokens (default 512; 24 quick)")
    args = p.parse_args(argv)
    args.prompts = args.prompts or (2 if args.quick else 32)
    args.prompt_tokens = args.prompt_tokens or ((8, 16) if args.quick else (128, 256))
    args.response_tokens = args.response_tokens or (24 if args.quick else 512)
    if args.prompts % args.minis:
        p.error(f"--prompts={args.prompts} must be a multiple of --minis={args.minis} (whole groups per mini-batch)")
    return args


def recipe(args, model_dir: str, world: int) -> list[str]:
    prompts = args.prompts * world
    quick = args.quick
    return [f"model.path={model_dir}", f"model.dtype={'float32' if quick else 'bfloat16'}",
            f"data.max_prompt_length={args.prompt_tokens[1]}", f"data.max_response_length={args.response_tokens}",
            "rl.enabled=true", "rl.rollout.engine=cuda", f"rl.rollout.n={4 if quick else 8}",
            f"rl.rollout.max_num_seqs={args.prompts * (4 if quick else 8)}", "rl.rollout.temperature=1.0",
            f"rl.train_batch_size={prompts}", f"rl.actor.ppo_mini_batch_size={prompts // args.minis}",
            "rl.actor.use_dynamic_bsz=true", "rl.actor.max_token_len_per_device=24576", "rl.actor.optim.lr=1e-6",
            "rl.actor.use_kl_loss=false", "rl.algorithm.adv_estimator=grpo", "rl.rollout.logprob_check_tol=1.0",
            f"ray.num_devices_per_node={world}", *args.set]


def reward(lengths):
    return (lengths % 7) / 6  # cheap and varied within a group (of the responses' lengths)


def build_model_dir(quick: bool, device: str, hazard: float = 1 / 200, shape: str = "0.5b") -> tuple:
    """The workload model (EOS calibrated) and a word-level tokenizer, saved as an HF folder (bf16 on GPU):
    (folder, EOS calibration, number of parameters, model config)."""
    import torch

    from bench.gpu_common import calibrate_eos, num_params, word_tokenizer, workload_model

    model = workload_model(quick, device, torch.float32, shape=shape)
    info = calibrate_eos(model, hazard=hazard)
    folder = tempfile.mkdtemp(prefix="gpu-worker-model-")
    tokenizer = word_tokenizer(model.config)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.to(torch.float32 if quick else torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, info, num_params(model), model.config


class Bench:
    def __init__(self, args, rank: int, world: int):
        import torch

        from infra.config import load_config
        from stages.workers.actor_rollout import ActorRolloutWorker

        self.args, self.rank, self.world = args, rank, world
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # every rank builds the same model (same seed) in its own folder: no file system is shared here
        model_dir, self.eos_info, self.params, self.config = build_model_dir(args.quick, self.device, args.hazard,
                                                                               args.shape)
        self.cfg = load_config(None, recipe(args, model_dir, world))
        self.mini_rows = self.cfg.rl.actor.ppo_mini_batch_size * self.cfg.rl.rollout.n
        self.worker = ActorRolloutWorker(self.cfg, model_dir, rank, world, os.environ["MASTER_ADDR"],
                                         int(os.environ["MASTER_PORT"]))
        self.step_index = 0

    def prompts(self, rank: int) -> list[list[int]]:
        """Rank `rank`'s prompts of this step (every rank can make every rank's: the driver holds them all)."""
        from bench.gpu_common import workload_prompts

        lo, hi = self.args.prompt_tokens
        seed = 1000 * self.step_index + rank  # different prompts on every rank and step
        return workload_prompts(self.args.prompts, lo, hi, self.config.vocab_size, self.config.eos_token_id, seed)

    def phase(self, name: str, times: dict, peaks: dict, fn, *args):
        import torch
        import torch.distributed as dist

        from bench.gpu_common import reset_peak

        reset_peak()
        start = time.perf_counter()
        result = fn(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            peaks[f"peak_gib/{name}"] = torch.cuda.max_memory_allocated() / 2**30
            peaks[f"reserved_gib/{name}"] = torch.cuda.max_memory_reserved() / 2**30
        dist.barrier()
        times[name] = time.perf_counter() - start
        return result

    def run(self, profile: Path | None = None) -> dict:
        """One GRPO step; `profile`: the phase of --profile under torch.profiler, kernel tables written there."""
        from stages.rollout.base import SamplingParams
        from stages.workers.memory import compiled_graphs

        times, peaks = {}, {}
        ro = self.cfg.rl.rollout
        params = SamplingParams(n=ro.n, temperature=ro.temperature, max_tokens=self.cfg.data.max_response_length,
                                stop_token_ids=(self.config.eos_token_id,), seed=self.step_index * 100 + self.rank)
        every = [self.prompts(r) for r in range(self.world)]
        prompts = every[self.rank]
        batch, info = self.phase("gen", times, peaks, self.generate, every, params)
        shard = batch.select(self.rows(batch))
        t = shard.tensors
        t["old_logprobs"], t["entropy"] = self.phase("old_log_prob", times, peaks, self.worker.compute_logprobs,
                                                     shard, "actor", True)
        self.phase("adv", times, peaks, self.advantages, batch, shard)
        calls = {"update_actor": self.worker.update_actor, "sync": self.worker.sync_weights}
        if profile is not None:
            from bench.gpu_common import profile_phase

            def profiled(*args, call=calls[self.args.profile]):
                result, self.profile = profile_phase(lambda: call(*args), profile)
                return result

            calls[self.args.profile] = profiled
        metrics = self.phase("update_actor", times, peaks, calls["update_actor"], shard)
        step, last = self.step_index + 1, self.args.warmup + self.args.steps  # the stage's rule, its steps from 1
        checked = self.cfg.rl.rollout.check_due(step, last, first=self.step_index == 0)
        sync = self.phase("sync", times, peaks, calls["sync"], prompts[:2] if checked else [])
        times["step"] = sum(times[p] for p in PHASES)
        self.step_index += 1
        worker_peaks = {f"worker/{k}": v for k, v in self.worker.memory_metrics().items()}  # the step's own metrics
        return {**{f"timing_s/{k}": v for k, v in times.items()}, **peaks, **worker_peaks, **info,
                "actor/grad_norm": metrics["actor/grad_norm"], "actor/pg_loss": metrics["actor/pg_loss"],
                "rollout/logprob_diff_max": sync.get("rollout/logprob_diff_max", float("nan")),
                **{k: v for k, v in sync.items() if k.startswith("timing_s/")},  # push and check
                "local_tokens": int(shard.tensors["attention_mask"].sum()),
                "compiled_graphs": compiled_graphs()}  # recompiles show here

    def generate(self, every: list[list[list[int]]], params):
        """This rank's rollouts of its prompts (`every[rank]`), then the driver's part: gather the outputs (not the
        prompts: the driver has them, as in stages/rl.py), build, score, balance (every rank alike), each timed."""
        import torch
        import torch.distributed as dist

        from stages.batch import balance_batch, build_batch
        from stages.rollout.base import PackedOutputs

        start = time.perf_counter()
        outs = self.worker.generate(every[self.rank], params)  # PackedOutputs on the host: the engine is done
        engine_s = time.perf_counter() - start
        gathered: list = [None] * self.world
        dist.barrier()  # the wait for the slowest engine is not the gather's
        marks = [time.perf_counter()]
        dist.all_gather_object(gathered, outs)  # arrays, as Ray brings the stage's driver
        marks.append(time.perf_counter())
        size = len(every[0])
        outputs = PackedOutputs.concat(gathered, [range(r * size, (r + 1) * size) for r in range(self.world)])
        prompts = [p for part in every for p in part]
        rows = outputs.prompt_index.tolist()
        batch = build_batch([prompts[i] for i in rows], outputs.split(outputs.token_ids),
                            outputs.split(outputs.logprobs), pad_token_id=self.config.pad_token_id,
                            meta={"group_id": rows})  # the arrays of single-turn trajectories, as the stage's
        batch.tensors["scores"] = torch.from_numpy(reward(outputs.lengths)).float()
        marks.append(time.perf_counter())
        batch, seqlen = balance_batch(batch, self.world, self.mini_rows)
        marks.append(time.perf_counter())
        gather_s, build_s, balance_s = (b - a for a, b in zip(marks, marks[1:]))
        mask = batch.response_mask
        info = {"timing_s/gen_engine": engine_s, "timing_s/gen_gather": gather_s, "timing_s/gen_build": build_s,
                "timing_s/gen_balance": balance_s, "sequences": len(batch), "response_tokens": int(mask.sum()),
                "tokens": int(batch.tensors["attention_mask"].sum()), **seqlen}
        return batch, info

    def rows(self, batch) -> list[int]:
        from stages.batch import rank_rows

        return rank_rows(len(batch), self.world, self.mini_rows)[self.rank]

    def advantages(self, batch, shard) -> None:
        """GRPO advantages over the global batch's groups; this rank keeps its rows' values."""
        import torch

        from stages.batch import token_level_scores
        from stages.core import AdvantageInputs, compute_advantages

        mask = batch.response_mask
        rewards = token_level_scores(batch.tensors["scores"], mask)
        adv, _ = compute_advantages("grpo", AdvantageInputs(token_level_rewards=rewards, response_mask=mask,
                                                            index=batch.meta["group_id"]))
        shard.tensors["advantages"] = adv[torch.tensor(self.rows(batch))]


def reduce_step(figures: dict) -> dict:
    """Rank figures -> the step's: times and peaks max over ranks, local token counts summed."""
    import torch
    import torch.distributed as dist

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for key, value in figures.items():
        t = torch.tensor(float(value), dtype=torch.float64, device=device)
        summed = key == "local_tokens"
        dist.all_reduce(t, op=dist.ReduceOp.SUM if summed else dist.ReduceOp.MAX)
        out[key] = t.item()
    return out


def summarize(timed: list[dict], params: int, peak_tflops: float | None, world: int, ppo_epochs: int) -> dict:
    """Phase times and memory: medians over the timed steps. Rates: totals over the timed steps (the steps sample
    other response lengths, so a median of tokens over a median of times would pair figures of different steps);
    the per-step tokens/s spread beside them."""
    med = {k: statistics.median(f[k] for f in timed) for k in timed[0]}
    total = {k: sum(f[k] for f in timed) for k in timed[0]}
    step = total["timing_s/step"]
    per_step = [f["tokens"] / f["timing_s/step"] for f in timed]
    summary = {**{k: med[k] for k in med if k.startswith(("timing_s/", "peak_gib/", "reserved_gib/"))},
               "step_s": med["timing_s/step"], "sequences_per_step": med["sequences"],
               "seq_per_s": total["sequences"] / step, "tok_per_s": total["tokens"] / step,
               "tok_per_s_steps_min": min(per_step), "tok_per_s_steps_max": max(per_step),
               "gen_response_tok_per_s": total["response_tokens"] / total["timing_s/gen"]}
    if peak_tflops:  # tokens of all ranks over all GPUs' peak: 6 (2 forward) x params FLOPs per token
        peak = peak_tflops * 1e12 * world
        tokens = total["local_tokens"]
        summary["mfu/update_actor"] = 6 * params * tokens * ppo_epochs / total["timing_s/update_actor"] / peak
        summary["mfu/old_log_prob"] = 2 * params * tokens / total["timing_s/old_log_prob"] / peak
    return summary


def main(argv=None) -> None:
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc_per_node=N bench/gpu_worker.py ...")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # one GPU per worker, as Ray gives it (before anything initialises CUDA), and one OpenMP thread unless
    # OMP_NUM_THREADS says otherwise (torchrun sets it at N > 1 only; at N = 1 the process would get every core,
    # 0.59x the step's tokens/s on a 64-core host). The stage's GPU workers take up to GPU_WORKER_THREADS (4): 1 and
    # 4 gave the same rates within the runs' spread (bench/results/2026-11-27-gpu-packed-outputs.md).
    os.environ["CUDA_VISIBLE_DEVICES"] = "" if args.quick else os.environ["LOCAL_RANK"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    from bench.gpu_common import Results, machine, measure_ceilings

    res = Results(f"{args.name}-n{world}", args.out) if rank == 0 else None
    t0 = time.perf_counter()
    bench = Bench(args, rank, world)
    ceilings = measure_ceilings() if torch.cuda.is_available() else {}
    if res:
        res.add("machine", {**machine(), "world_size": world, "backend": dist.get_backend(), **ceilings})
        res.add("config", {"args": {k: v for k, v in vars(args).items() if k != "out"},
                           "overrides": recipe(args, "<model>", world)})
        res.add("setup", {"setup_s": time.perf_counter() - t0, "params": bench.params, **bench.eos_info})
    timed = []
    for i in range(args.warmup + args.steps):
        figures = reduce_step(bench.run())
        if i >= args.warmup:
            timed.append(figures)
        if res:
            res.add(f"step{i}" + ("_warmup" if i < args.warmup else ""), figures)
    if res:
        summary = summarize(timed, bench.params, ceilings.get("bf16_matmul_tflops"), world,
                            bench.cfg.rl.actor.ppo_epochs)
        res.add("summary", summary)
        rows = [(f"N={world}: step s", summary["step_s"], "median of timed steps"),
                *[(f"N={world}: {p} s", summary[f"timing_s/{p}"], "slowest rank") for p in PHASES],
                (f"N={world}:   of gen, the engine s", summary["timing_s/gen_engine"],
                 "slowest rank; the rest: gather, build, balance"),
                *[(f"N={world}:   of gen, {p} s", summary[f"timing_s/gen_{p}"], "slowest rank")
                  for p in ("gather", "build", "balance")],
                *[(f"N={world}:   of sync, {p} s", summary.get(f"timing_s/sync_{p}", float("nan")), "slowest rank")
                  for p in ("push", "check")],
                (f"N={world}: sequences/s", summary["seq_per_s"], f"{summary['sequences_per_step']:.0f} per step"),
                (f"N={world}: tokens/s (prompt + response)", summary["tok_per_s"],
                 f"steps {summary['tok_per_s_steps_min']:,.0f}-{summary['tok_per_s_steps_max']:,.0f}")]
        rows += [(f"N={world}: {k}", v, "") for k, v in summary.items() if k.startswith(("mfu/", "peak_gib/"))]
    if args.profile:
        folder = res.out if res else Path(tempfile.mkdtemp())
        figures = reduce_step(bench.run(profile=folder / f"profile-{args.name}-n{world}.txt"))
        if res:
            busy = bench.profile["device_busy_s"]
            phase = args.profile
            res.add("profile", {**bench.profile, "phase": phase, "phase_s": figures[f"timing_s/{phase}"],
                                "busy_share_of_unprofiled": busy / summary[f"timing_s/{phase}"]})
            rows += [(f"profiled {phase}: device busy s", busy, f"of {summary[f'timing_s/{phase}']:.3f} s "
                      "unprofiled (median)"),
                     *[(f"  {k}", v, "") for k, v in bench.profile.items() if k.startswith("kernel_s/")]]
    if res:
        res.table(rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
