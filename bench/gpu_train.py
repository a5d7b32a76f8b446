"""Actor-update speed on one GPU: packed sequences against today's padded path; MFU against the measured peak.

    python bench/gpu_train.py [--out DIR] [--variants naive,packed,packed_compiled]   # on the GPU machine
    PYTHONPATH=. .venv/bin/python bench/gpu_train.py --quick                         # CPU smoke test

Workload: the rollout benchmark's 512 sequences (64 prompts x 8): prompts of 128-256 tokens, response
lengths drawn from the same EOS hazard (geometric, p = 1/200, capped at 512), random tokens. One actor
update is a PPO pass as the worker runs it: 4 mini-batches of 128 sequences (16 prompts), each split into
micro-batches, the vanilla clipped loss with token-mean over global denominators (stages.core), gradient
clipping at 1.0 and an AdamW step. The trainer is set up as the worker sets it up: fp32 master weights,
FSDP2 `fully_shard` per decoder layer and at the root (world size 1), bf16 compute through
MixedPrecisionPolicy, TokenLogprobs around the transformers model. No gradient checkpointing (the peak
memory below shows it is not needed at 16k tokens per micro-batch).

Variants:
  naive            padded micro-batches of 16 rows (global padding), head uncompiled, AdamW (foreach)
  packed           micro-batches of <= 16,384 real tokens packed without padding, AdamW (fused)
  packed_compiled  packed + every decoder layer and the chunked head compiled
  packed_compiled_keep_head  + the head's chunks keep their activations (no recomputed vocabulary matmul)
  tuned            packed_compiled + FSDP2 keeps the bf16 weights unsharded between forward and backward
                   (reshard_after_forward=False: one device, nothing to save), gradients reduced once per
                   mini-batch (set_requires_gradient_sync), entropy as a metric without gradient (no entropy
                   bonus), micro-batches of <= 24,576 tokens, head chunks of 8,192
  tuned_big        tuned with micro-batches of <= 49,152 tokens (one per mini-batch here) and head chunks of
                   16,384 (fewer, larger kernels; needs the H200's memory)

MFU = 6 x params x tokens / seconds / measured bf16 matmul rate, tokens = real (prompt + response) tokens
of the update; attention FLOPs are not counted. Also measured: the no-grad logprob pass (old logprobs),
peak memory of each phase, and weight sync into the cuda rollout engine (two ways).
"""

from __future__ import annotations

import argparse
import gc
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import (  # noqa: E402
    Results,
    machine,
    measure_ceilings,
    num_params,
    peak_gib,
    profile_kernels,
    reset_peak,
    workload_model,
    workload_prompts,
)
from stages.batch import Batch, build_batch  # noqa: E402
from stages.core import POLICY_LOSSES, loss_denominators  # noqa: E402
from stages.model.policy import TokenLogprobs, compile_layers, hf_parts  # noqa: E402
from stages.rollout.base import SamplingParams  # noqa: E402
from stages.rollout.cuda_engine import CudaRolloutEngine  # noqa: E402

_PACKED = {"pack": True, "compile": False, "fused": True, "micro_tokens": 16384, "chunk_tokens": 4096,
           "checkpoint_head": True, "reshard": True, "sync_each_micro": True, "entropy_grad": True}
VARIANTS = {
    "naive": {**_PACKED, "pack": False, "fused": False, "micro_rows": 16, "chunk_tokens": 1024},
    "packed": _PACKED,
    "packed_compiled": {**_PACKED, "compile": True},
    "packed_compiled_keep_head": {**_PACKED, "compile": True, "checkpoint_head": False},
    "tuned": {**_PACKED, "compile": True, "reshard": False, "sync_each_micro": False, "entropy_grad": False,
              "micro_tokens": 24576, "chunk_tokens": 8192},
}
VARIANTS["tuned_big"] = {**VARIANTS["tuned"], "micro_tokens": 49152, "chunk_tokens": 16384}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--variants", default="naive,packed,packed_compiled,tuned,tuned_big")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", default="", help="variant whose update gets a kernel table (profile-train-*.txt)")
    return p.parse_args()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def workload_batch(quick: bool, vocab: int, eos: int, seed: int = 0) -> Batch:
    num_prompts, n, lo, hi, max_tokens = (4, 4, 8, 16, 32) if quick else (64, 8, 128, 256, 512)
    prompts = [p for p in workload_prompts(num_prompts, lo, hi, vocab, eos, seed) for _ in range(n)]
    g = torch.Generator().manual_seed(seed + 1)
    lengths = (torch.empty(len(prompts)).geometric_(1 / 200, generator=g).long().clamp(1, max_tokens)).tolist()
    responses = [torch.randint(0, eos, (k,), generator=g).tolist() for k in lengths]
    batch = build_batch(prompts, responses, [[0.0] * k for k in lengths], pad_token_id=eos + 1)
    mask = batch.response_mask
    batch.tensors["old_logprobs"] = (-torch.rand(mask.shape, generator=g) * 3) * mask
    batch.tensors["advantages"] = torch.randn(len(prompts), 1, generator=g).expand(mask.shape) * mask
    return batch


def micro_groups(batch: Batch, variant: dict) -> list[list[int]]:
    rows = list(range(len(batch)))
    if "micro_rows" in variant:
        return [rows[s : s + variant["micro_rows"]] for s in range(0, len(rows), variant["micro_rows"])]
    lengths = batch.tensors["attention_mask"].sum(-1).tolist()
    groups, current, tokens = [], [], 0
    for row in rows:
        if current and tokens + lengths[row] > variant["micro_tokens"]:
            groups.append(current)
            current, tokens = [], 0
        current.append(row)
        tokens += lengths[row]
    return groups + [current]


def build_actor(quick: bool, variant: dict, device: str):
    model = workload_model(quick, device, torch.float32)  # fp32 master weights, as the worker keeps them
    module = TokenLogprobs(model, chunk_tokens=variant["chunk_tokens"], pack=variant["pack"],
                           compile_head=variant["compile"], checkpoint_head=variant["checkpoint_head"])
    if variant["compile"]:
        compile_layers(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device == "cuda" else None
    kwargs = {"mp_policy": policy, "reshard_after_forward": variant["reshard"]} if policy else {}
    body, _ = hf_parts(model)
    for layer in body.layers:
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    extra = {"fused": True} if variant["fused"] and device == "cuda" else {}
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-6, **extra)
    return model, module, optimizer


def to_device(tensors: dict, device: str) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in tensors.items()}


def actor_update(module, optimizer, batch: Batch, variant: dict, device: str, mini_rows: int) -> dict:
    losses = []
    for start in range(0, len(batch), mini_rows):
        mini = batch.select(list(range(start, min(start + mini_rows, len(batch)))))
        denominators = to_device(loss_denominators(mini.response_mask), device)
        groups = micro_groups(mini, variant)
        for i, rows in enumerate(groups):
            if not variant["sync_each_micro"]:
                module.set_requires_gradient_sync(i == len(groups) - 1)
            micro = mini.select(rows)
            t = to_device(micro.tensors, device)
            logprobs, _ = module(**to_device(micro.model_inputs(), device), temperature=1.0, with_entropy=True,
                                 entropy_grad=variant["entropy_grad"])
            loss, _ = POLICY_LOSSES.get("vanilla")(
                t["old_logprobs"], logprobs, t["advantages"], t["response_mask"], "token-mean", clip_ratio_low=0.2,
                clip_ratio_high=0.2, **denominators, max_response_length=batch.num_response_tokens)
            loss.backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"loss_sum": float(torch.stack(losses).sum())}


@torch.no_grad()
def logprob_pass(module, batch: Batch, variant: dict, device: str) -> None:
    for rows in micro_groups(batch, variant):
        module(**to_device(batch.select(rows).model_inputs(), device), temperature=1.0)


def run_variant(name: str, args, batch: Batch, res: Results, peak_tflops: float, device: str):
    variant = VARIANTS[name]
    model, module, optimizer = build_actor(args.quick, variant, device)
    params = num_params(model)
    tokens = int(batch.tensors["attention_mask"].sum())
    mini_rows = 16 if args.quick else 128
    start = time.perf_counter()
    actor_update(module, optimizer, batch, variant, device, mini_rows)  # warm-up (compilation, allocator)
    sync()
    res.add(name, {"warmup_s": time.perf_counter() - start})
    reset_peak()
    times = []
    for _ in range(args.repeats):
        sync()
        start = time.perf_counter()
        actor_update(module, optimizer, batch, variant, device, mini_rows)
        sync()
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    res.add(name, {"update_s": seconds, "tokens": tokens, "tok_s": tokens / seconds,
                   "mfu": 6 * params * tokens / seconds / (peak_tflops * 1e12), "update_peak_gib": peak_gib(),
                   "micro_batches": len(micro_groups(batch, variant))})
    module.eval()
    logprob_pass(module, batch, variant, device)
    reset_peak()
    sync()
    start = time.perf_counter()
    logprob_pass(module, batch, variant, device)
    sync()
    seconds = time.perf_counter() - start
    res.add(name, {"logprob_pass_s": seconds, "logprob_pass_mfu": 2 * params * tokens / seconds / (peak_tflops * 1e12),
                   "logprob_pass_peak_gib": peak_gib()})
    module.train()
    if args.profile == name and device == "cuda":
        print(profile_kernels(lambda: actor_update(module, optimizer, batch, variant, device, mini_rows),
                              res.out / f"profile-train-{name}.txt"), flush=True)
    return model, module, optimizer


def weight_sync(module, args, res: Results, device: str) -> None:
    """Trainer -> engine: (a) full state dict gathered to CPU (today's path), (b) on device, tensor by tensor."""
    fresh = workload_model(args.quick, device, torch.float32 if args.quick else torch.bfloat16, seed=1)
    engine = CudaRolloutEngine(fresh, fresh.config.eos_token_id, max_num_seqs=256, max_model_len=768)
    del fresh
    sync()
    start = time.perf_counter()
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    engine.update_weights({k.removeprefix("lm."): v for k, v in state.items()})
    sync()
    cpu_s = time.perf_counter() - start
    del state
    start = time.perf_counter()
    engine.update_weights((k.removeprefix("lm."), v.full_tensor() if hasattr(v, "full_tensor") else v)
                          for k, v in module.state_dict().items())
    sync()
    device_s = time.perf_counter() - start
    # the engine now generates with the trainer's weights: greedy tokens re-scored by the trainer
    prompts = workload_prompts(4, 16, 32, engine.decoder.shape.vocab, engine.eos_token_id, seed=5)
    outs = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_tokens=32, stop_token_ids=(-1,)))
    batch = build_batch([prompts[o.prompt_index] for o in outs], [o.response_ids for o in outs],
                        [o.logprobs for o in outs], pad_token_id=0)
    module.eval()
    with torch.no_grad():
        lp, _ = module(**to_device(batch.model_inputs(), device), temperature=1.0)
    diff = (lp.float().cpu() - batch.tensors["rollout_logprobs"]).abs()[batch.response_mask]
    res.add("weight_sync", {"cpu_gather_s": cpu_s, "on_device_s": device_s, "engine_vs_trainer_logprob_max":
                            diff.max().item(), "engine_vs_trainer_logprob_mean": diff.mean().item()})


def main() -> None:
    args = parse_args()
    device = "cpu" if args.quick else "cuda"
    res = Results("gpu-train", args.out)
    res.add("machine", machine())
    peak = measure_ceilings()["bf16_matmul_tflops"] if device == "cuda" else 1.0
    res.add("ceilings", {"bf16_matmul_tflops": peak})
    with socket.socket() as sock:  # a free port for the one-rank process group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    probe = workload_model(args.quick, "cpu")
    c = probe.config
    batch = workload_batch(args.quick, c.vocab_size, c.eos_token_id)
    lengths = batch.tensors["attention_mask"].sum(-1).float()
    res.add("workload", {"params": num_params(probe), "sequences": len(batch), "tokens": int(lengths.sum()),
                         "padded_tokens": batch.tensors["attention_mask"].numel(),
                         "response_len_mean": batch.response_mask.sum(-1).float().mean().item()})
    del probe
    last = None
    for name in args.variants.split(","):
        if VARIANTS[name]["compile"] and device == "cpu":
            print(f"{name}: skipped on CPU (compiled variants run on the GPU machine)")
            continue
        last = None
        gc.collect()
        torch.cuda.empty_cache() if device == "cuda" else None
        last = res.attempt(name, run_variant, name, args, batch, res, peak, device) or last
    if last is not None:
        res.attempt("weight_sync", weight_sync, last[1], args, res, device)
    summary(res)
    dist.destroy_process_group()


def summary(res: Results) -> None:
    d = res.data
    rows = []
    for name in VARIANTS:
        if name in d and "update_s" in d[name]:
            v = d[name]
            rows += [(f"{name}: actor update s | tok/s", f"{v['update_s']:.2f} | {v['tok_s']:,.0f}", ""),
                     (f"{name}: MFU", v["mfu"], "target >= 0.45 (naive path measured 0.22 elsewhere)"),
                     (f"{name}: peak GiB update | logprob pass", f"{v['update_peak_gib']:.1f} | "
                      f"{v['logprob_pass_peak_gib']:.1f}", f"logprob pass {v['logprob_pass_s']:.2f} s")]
    w = d.get("weight_sync", {})
    if w:
        rows += [("weight sync s: cpu gather | on device", f"{w['cpu_gather_s']:.2f} | {w['on_device_s']:.3f}", ""),
                 ("engine vs trainer logprob max diff", w["engine_vs_trainer_logprob_max"], "after sync, greedy")]
    rows.append(("bf16 matmul TFLOP/s", d["ceilings"]["bf16_matmul_tflops"], d["machine"].get("gpu", "cpu")))
    res.table(rows)


if __name__ == "__main__":
    main()
