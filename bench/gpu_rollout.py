"""Rollout throughput on one GPU: the `cuda` engine against transformers' `generate`, same model and prompts.

    python bench/gpu_rollout.py [--out DIR] [--skip-hf] [--variants] [--fp8] [--shape 7b]   # on the GPU machine
    PYTHONPATH=. .venv/bin/python bench/gpu_rollout.py --quick            # CPU smoke test, tiny shapes

Workload: bench/gpu_common.py (Qwen2.5-0.5B shape, random bf16 weights, calibrated EOS), 64 prompts x n=8
at T=1, 256 concurrent sequences. Measured, in one process: the machine's bf16 matmul rate and copy
bandwidth; our engine end to end (first call with compilation and graph capture, then timed calls:
generated tokens / wall seconds, prefill included); one decode step at 256 sequences (graph replays,
CUDA events) against its byte/FLOP floor; greedy agreement with `generate` and logprob agreement with
the trainer's TokenLogprobs; transformers `generate` (dynamic cache) on 256 sequences as the baseline.
`--fp8`: the same engine with `quantization="fp8"` beside it (tokens/s, decode step, logprob gap to the
bf16 trainer and to fp32).
Writes gpu-rollout.json under --out (default $OUT) and prints a short table last.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import (  # noqa: E402
    Results,
    calibrate_eos,
    cuda_time,
    machine,
    measure_ceilings,
    num_params,
    peak_gib,
    profile_kernels,
    reset_peak,
    workload_model,
    workload_prompts,
)
from stages.batch import build_batch  # noqa: E402
from stages.model.policy import TokenLogprobs  # noqa: E402
from stages.rollout.base import SamplingParams  # noqa: E402
from stages.rollout.cuda_engine import CudaRolloutEngine  # noqa: E402
from stages.rollout.sampling import SamplingMode  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="tiny model and workload (CPU smoke test)")
    p.add_argument("--out", default=None)
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers generate baseline")
    p.add_argument("--variants", action="store_true",
                   help="also time the engine with flash attention, with torch sampling, with sdpa and no compile")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--fp8", action="store_true", help="also the fp8 engine (rl.rollout.quantization=fp8)")
    p.add_argument("--shape", default="0.5b", choices=["0.5b", "1.5b", "3b", "7b"], help="Qwen2.5 shape")
    p.add_argument("--profile", action="store_true", help="profile eager decode steps at full batch (kernel table)")
    p.add_argument("--split-attention", action="store_true",
                   help="also the engine with the split-KV kernel at every batch size (the decode path before "
                        "2026-11-26: rotation kernel, split kernel, combine kernel)")
    p.add_argument("--attention-tiling", nargs="*", default=[], metavar="SPLIT,BLOCK_N,WARPS,STAGES",
                   help="also engines whose decode attention uses these tilings (bench/gpu_decode_kernels.py)")
    return p.parse_args()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def lengths_summary(outs, max_tokens: int) -> dict:
    lengths = torch.tensor([len(o.response_ids) for o in outs], dtype=torch.float)
    return {"response_len_mean": lengths.mean().item(), "response_len_p50": lengths.median().item(),
            "response_len_p90": lengths.quantile(0.9).item(),
            "frac_max_tokens": (lengths >= max_tokens).float().mean().item()}


def timed_generate(engine, prompts, params):
    sync()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync()
    seconds = time.perf_counter() - start
    return outs, seconds, sum(len(o.response_ids) for o in outs)


def fill_slots(engine, low: int, high: int) -> None:
    """Every slot busy, at positions uniform in [low, high)."""
    s, b = engine.slots, engine.max_num_seqs
    g = torch.Generator().manual_seed(0)
    s.pos[:b] = torch.randint(low, high, (b,), generator=g).to(s.pos.device)
    s.token[:b] = torch.randint(0, 1000, (b,), generator=g).to(s.pos.device)
    s.gen[:b], s.done[:b] = 0, False


def decode_step_seconds(engine, low: int, high: int) -> dict:
    """One decode step at full batch: graph replay and eager (the difference is launch overhead)."""
    b, mode = engine.max_num_seqs, SamplingMode(False)
    fill_slots(engine, low, high)
    graph, _ = engine.graphs.get(b, engine.decoder.max_len, mode)
    replay = cuda_time(lambda: [graph.replay() for _ in range(10)], warmup=1, repeat=5) / 10
    fill_slots(engine, low, high)
    eager = cuda_time(lambda: [engine._decode_step(b, engine.decoder.max_len, mode) for _ in range(5)], warmup=1,
                      repeat=3) / 5
    engine.slots.reset_from(0)
    return {"step_ms": replay * 1e3, "eager_step_ms": eager * 1e3}


def profile_decode(engine, low: int, high: int, out: Path) -> None:
    b, mode = engine.max_num_seqs, SamplingMode(False)
    fill_slots(engine, low, high)
    print(profile_kernels(lambda: [engine._decode_step(b, engine.decoder.max_len, mode) for _ in range(5)],
                          out / "profile-decode.txt"), flush=True)
    engine.slots.reset_from(0)


def step_floor(model, batch: int, mean_context: float, ceilings: dict) -> dict:
    """Fewest bytes and FLOPs of one decode step and the time each takes at the measured ceilings."""
    c = model.config
    params = num_params(model)
    head_dim = c.hidden_size // c.num_attention_heads
    kv = batch * mean_context * c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 2
    sampling = batch * c.vocab_size * (2 + 2)  # bf16 logits written and read (the sampler draws by hash, no uniforms)
    weights = 2 * params
    flops = 2 * params * batch + c.num_hidden_layers * 4 * batch * mean_context * c.num_attention_heads * head_dim
    byte_s = (weights + kv + sampling) / (ceilings["copy_tb_s"] * 1e12)
    flop_s = flops / (ceilings["bf16_matmul_tflops"] * 1e12)
    return {"floor_bytes_gb": (weights + kv + sampling) / 1e9, "floor_weights_gb": weights / 1e9,
            "floor_kv_gb": kv / 1e9, "floor_sampling_gb": sampling / 1e9, "floor_gflop": flops / 1e9,
            "floor_bytes_ms": byte_s * 1e3, "floor_flops_ms": flop_s * 1e3}


@torch.no_grad()
def hf_generate(model, prompts, params, pad_id: int, eos_id: int, greedy: bool = False):
    """transformers generate with its default dynamic cache, left padding; returns outputs, seconds, tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": params.temperature, "top_k": 0,
                                                    "top_p": 1.0}
    sync()
    start = time.perf_counter()
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                         max_new_tokens=params.max_tokens, num_return_sequences=1 if greedy else params.n,
                         eos_token_id=eos_id, pad_token_id=pad_id, **sampling)
    sync()
    seconds = time.perf_counter() - start
    responses = []
    for row in out[:, width:].tolist():
        responses.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return responses, seconds, sum(len(r) for r in responses)


def agreement(model, engine, prompts, eos_id: int, pad_id: int, max_tokens: int) -> dict:
    """Greedy tokens of the engine vs transformers generate (both bf16, same weights)."""
    params = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
    ours = [o.response_ids for o in engine.generate(prompts, params)]
    theirs, _, _ = hf_generate(model, prompts, params, pad_id, eos_id, greedy=True)
    prefix = []
    for a, b in zip(ours, theirs):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(k / max(len(b), 1))
    return {"greedy_identical_frac": sum(a == b for a, b in zip(ours, theirs)) / len(ours),
            "greedy_common_prefix_frac": sum(prefix) / len(prefix)}


@torch.no_grad()
def logprob_gap(model, outs, prompts, pad_id: int, temperature: float, rows: int = 32) -> dict:
    """Engine logprobs of the first `rows` samples against the trainer's TokenLogprobs in bf16 and in fp32 (a
    float32 copy of the same weights); trainer bf16 vs fp32 is the yardstick of bf16 rounding alone."""
    import copy

    outs = outs[:rows]
    batch = build_batch([prompts[o.prompt_index] for o in outs], [o.response_ids for o in outs],
                        [o.logprobs for o in outs], pad_token_id=pad_id)
    inputs = {k: v.to(model.device) if torch.is_tensor(v) else v for k, v in batch.model_inputs().items()}
    mask = batch.response_mask
    trainer = {}
    for label, lm in (("bf16", model), ("fp32", copy.deepcopy(model).float())):
        lp, _ = TokenLogprobs(lm, chunk_tokens=2048)(**inputs, temperature=temperature)
        trainer[label] = lp.float().cpu()
    engine = batch.tensors["rollout_logprobs"]
    gap = lambda a, b: (a - b).abs()[mask]  # noqa: E731
    out = {}
    for label, diff in (("engine_vs_trainer_bf16", gap(engine, trainer["bf16"])),
                        ("engine_vs_fp32", gap(engine, trainer["fp32"])),
                        ("trainer_bf16_vs_fp32", gap(trainer["bf16"], trainer["fp32"]))):
        out[f"logprob_{label}_max"], out[f"logprob_{label}_mean"] = diff.max().item(), diff.mean().item()
    return out


def main() -> None:
    args = parse_args()
    res = Results("gpu-rollout", args.out)
    device = "cpu" if args.quick else "cuda"
    res.add("machine", machine())
    ceilings = measure_ceilings() if device == "cuda" else {"bf16_matmul_tflops": 1.0, "copy_tb_s": 0.01}
    res.add("ceilings", ceilings)

    model = workload_model(args.quick, device, torch.float32 if args.quick else torch.bfloat16, shape=args.shape)
    c = model.config
    res.add("workload", {"params": num_params(model), **calibrate_eos(model, hazard=1 / 200)})
    num_prompts, n, max_tokens, concurrency = (6, 4, 32, 8) if args.quick else (64, 8, 512, 256)
    lo, hi = (8, 16) if args.quick else (128, 256)
    prompts = workload_prompts(num_prompts, lo, hi, c.vocab_size, c.eos_token_id)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=0)
    res.add("workload", {"num_prompts": num_prompts, "n": n, "max_tokens": max_tokens, "concurrency": concurrency,
                         "prompt_tokens": sum(len(p) for p in prompts)})

    start = time.perf_counter()
    engine = CudaRolloutEngine(model, c.eos_token_id, max_num_seqs=concurrency, max_model_len=hi + max_tokens)
    res.add("engine", {"build_s": time.perf_counter() - start, "attention": engine.decoder.attention,
                       "kv_cache_gib": engine.decoder.kv_bytes() / 2**30})
    outs, seconds, tokens = timed_generate(engine, prompts, params)
    res.add("engine", {"first_call_s": seconds, "first_call_tok_s": tokens / seconds,
                       "first_call_capture_s": engine.stats["capture_s"]})
    reset_peak()
    for r in range(args.repeats):
        outs, seconds, tokens = timed_generate(engine, prompts, params)
        res.add("engine", {f"run{r}_s": seconds, f"run{r}_tokens": tokens, f"run{r}_tok_s": tokens / seconds,
                           **{f"run{r}_{k}": v for k, v in engine.stats.items()}})
    res.add("engine", {"peak_gib": peak_gib(), **lengths_summary(outs, max_tokens)})
    mean_context = sum(len(p) for p in prompts) / len(prompts) + res.data["engine"]["response_len_mean"] / 2

    if device == "cuda":
        res.attempt("decode_step", measure_step, res, engine, model, concurrency, lo, hi + max_tokens - 64, ceilings)
        if args.profile:
            res.attempt("profile", profile_decode, engine, lo, hi + max_tokens - 64, res.out)
    res.attempt("correctness", lambda e=engine: res.add("correctness", agreement(  # bound: `del engine` below
        model, e, prompts[:8], c.eos_token_id, c.pad_token_id, min(64, max_tokens))))
    res.attempt("correctness", lambda: res.add("correctness", logprob_gap(
        model, outs, prompts, c.pad_token_id, params.temperature)))
    del engine
    if args.fp8:
        res.attempt("fp8", fp8_engine, res, model, prompts, params, hi + max_tokens, concurrency, lo, ceilings)
    if args.split_attention:
        res.attempt("split_attention", split_engine, res, model, prompts, params, hi + max_tokens, concurrency, lo)
    for tiling in args.attention_tiling:
        res.attempt(f"tiling_{tiling}", tiled_engine, res, tiling, model, prompts, params, hi + max_tokens,
                    concurrency, lo)
    if args.variants:
        for label, kwargs in (("flash_attention", {"attention": "flash"}),
                              ("torch_sampling", {"fused_sampling": False}),
                              ("sdpa_no_compile", {"attention": "sdpa", "compile": False})):
            res.attempt(f"variant_{label}", measured_engine, res, f"variant_{label}", model, prompts, params,
                        hi + max_tokens, concurrency, lo, **kwargs)
    if not args.skip_hf:
        free_memory()
        reset_peak()
        subset = prompts[: concurrency // n]  # one generate call with `concurrency` sequences
        result = res.attempt("hf_generate", hf_generate, model, subset, params, c.pad_token_id, c.eos_token_id)
        if result is not None:
            _, seconds, tokens = result
            res.add("hf_generate", {"prompts": len(subset), "sequences": len(subset) * n, "s": seconds,
                                    "tokens": tokens, "tok_s": tokens / seconds, "peak_gib": peak_gib()})
    summary(res, mean_context)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_step(res, engine, model, concurrency: int, low: int, high: int, ceilings: dict) -> None:
    step = decode_step_seconds(engine, low, high)
    floor = step_floor(model, concurrency, (low + high) / 2, ceilings)
    res.add("decode_step", {**step, "tok_s_at_full_batch": concurrency / step["step_ms"] * 1e3, **floor})


def split_engine(res, model, prompts, params, max_model_len: int, concurrency: int, low: int) -> None:
    """The engine with the split-KV attention path at every batch size (no one-program-per-pair kernel)."""
    from stages.rollout import triton_kernels

    default = triton_kernels.DIRECT_MIN_PROGRAMS
    triton_kernels.DIRECT_MIN_PROGRAMS = 10**9
    try:
        measured_engine(res, "split_attention", model, prompts, params, max_model_len, concurrency, low)
    finally:
        triton_kernels.DIRECT_MIN_PROGRAMS = default


def tiled_engine(res, tiling: str, model, prompts, params, max_model_len: int, concurrency: int, low: int) -> None:
    """The engine with another tiling of its decode attention: tokens/s and the decode step."""
    import functools

    from stages.rollout import triton_kernels

    split, block_n, warps, stages = (int(x) if x not in ("", "-") else None for x in tiling.split(","))
    default = triton_kernels.decode_attention
    triton_kernels.decode_attention = functools.partial(default, split=split, block_n=block_n, num_warps=warps,
                                                        num_stages=stages)
    try:
        measured_engine(res, f"tiling_{tiling}", model, prompts, params, max_model_len, concurrency, low)
    finally:
        triton_kernels.decode_attention = default  # the engine took its own reference


def measured_engine(res, label: str, model, prompts, params, max_model_len: int, concurrency: int, low: int,
                    **kwargs) -> None:
    """An engine with other settings: tokens/s (best of two calls after a first) and the decode step."""
    free_memory()
    engine = CudaRolloutEngine(model, model.config.eos_token_id, max_num_seqs=concurrency,
                               max_model_len=max_model_len, **kwargs)
    timed_generate(engine, prompts, params)
    runs = [timed_generate(engine, prompts, params) for _ in range(2)]
    outs, seconds, tokens = min(runs, key=lambda r: r[1] / r[2])
    res.add(label, {"tok_s": tokens / seconds, "s": seconds,
                    **logprob_gap(model, outs, prompts, model.config.pad_token_id, params.temperature)})
    if torch.cuda.is_available():
        res.add(label, decode_step_seconds(engine, low, max_model_len - 64))


def fp8_engine(res, model, prompts, params, max_model_len: int, concurrency: int, low: int, ceilings: dict) -> None:
    """The engine with float8 projections: best of two timed calls, the decode step, the logprob gaps."""
    free_memory()
    reset_peak()
    engine = CudaRolloutEngine(model, model.config.eos_token_id, max_num_seqs=concurrency,
                               max_model_len=max_model_len, quantization="fp8")
    timed_generate(engine, prompts, params)  # compilation and graph capture
    runs = [timed_generate(engine, prompts, params) for _ in range(2)]
    outs, seconds, tokens = min(runs, key=lambda r: r[1] / r[2])
    res.add("fp8", {"tok_s": tokens / seconds, "s": seconds, "peak_gib": peak_gib(),
                    **lengths_summary(outs, params.max_tokens)})
    if torch.cuda.is_available():
        res.add("fp8", decode_step_seconds(engine, low, max_model_len - 64))
    res.add("fp8", logprob_gap(model, outs, prompts, model.config.pad_token_id, params.temperature))


def summary(res: Results, mean_context: float) -> None:
    d = res.data
    e = d["engine"]
    ours = max(v for k, v in e.items() if k.startswith("run") and k.endswith("_tok_s"))
    rows = [("cuda engine, generated tok/s (end to end, best run)", ours, "target >= 100,000 on one H200"),
            ("  first call (compile + graph capture) s", e["first_call_s"], ""),
            ("  response length mean / frac at max", f"{e['response_len_mean']:.0f} / {e['frac_max_tokens']:.2f}", ""),
            ("  mean context per sequence (tokens)", mean_context, ""),
            ("  peak GPU memory GiB", e["peak_gib"], "")]
    if "step_ms" in d.get("decode_step", {}):
        s = d["decode_step"]
        rows += [("decode step at full batch, ms", s["step_ms"],
                  f"floor {max(s['floor_bytes_ms'], s['floor_flops_ms']):.3f} ms (bytes {s['floor_bytes_ms']:.3f}, "
                  f"FLOPs {s['floor_flops_ms']:.3f})"),
                 ("  tok/s at full batch", s["tok_s_at_full_batch"], "")]
    if "tok_s" in d.get("hf_generate", {}):
        rows += [("transformers generate tok/s (dynamic cache)", d["hf_generate"]["tok_s"], "same run, 256 seqs"),
                 ("  speed-up", ours / d["hf_generate"]["tok_s"], "")]
    for key, value in d.get("correctness", {}).items():
        rows.append((key, value, ""))
    if "tok_s" in d.get("fp8", {}):
        f = d["fp8"]
        rows += [("fp8 engine tok/s (best of 2)", f["tok_s"], f"x{f['tok_s'] / ours:.2f} of bf16"),
                 ("  fp8 decode step at full batch, ms", f.get("step_ms", "-"), ""),
                 ("  fp8 logprob gap to bf16 trainer max / mean", f"{f['logprob_engine_vs_trainer_bf16_max']:.3f} / "
                  f"{f['logprob_engine_vs_trainer_bf16_mean']:.4f}", ""),
                 ("  fp8 logprob gap to fp32 max / mean",
                  f"{f['logprob_engine_vs_fp32_max']:.3f} / {f['logprob_engine_vs_fp32_mean']:.4f}", "")]
    for key in [k for k in d if k.startswith("tiling_") or k == "split_attention"]:
        rows.append((key + " tok/s | decode step ms", f"{d[key].get('tok_s', 0):,.0f} | {d[key].get('step_ms', 0):.3f}",
                     d[key].get("error", "")))
    for key in [k for k in d if k.startswith("variant_")]:
        rows.append((key + " tok/s", d[key].get("tok_s", d[key].get("error", "?")), ""))
    rows.append(("matmul TFLOP/s | copy TB/s", f"{d['ceilings']['bf16_matmul_tflops']:.0f} | "
                 f"{d['ceilings']['copy_tb_s']:.2f}", d["machine"].get("gpu", "cpu")))
    res.table(rows)


if __name__ == "__main__":
    main()
