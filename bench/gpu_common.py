"""Shared pieces of the GPU benchmarks: the workload model, its prompts, the machine's measured ceilings
and the results file.

Workload (issue 5): a Qwen2.5-0.5B-shaped model with random bf16 weights built from its config (no hub),
64 prompts x n=8, prompts of 128-256 random tokens, responses up to 512 tokens ending at a sampled EOS.

EOS: random weights give every token about the same probability (1/151,936), so nothing would ever
stop. `calibrate_eos` rescales the EOS row of the tied embedding (its direction kept, so it is the EOS
*logit* that moves: logit_eos = beta * <h, e_eos/|e_eos|>) and picks beta by bisection so that the mean
per-token EOS probability over the final hidden states of random prompts is `hazard` (default 1/200:
geometric-like lengths, mean about 180 of 512, about 8% hitting max_tokens). Since it is a weight change,
transformers' generate, our engine and the trainer all see the same model and the same lengths.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import subprocess
import time
import traceback
import warnings
from pathlib import Path

import torch

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
                  rope_theta=1_000_000.0, max_position_embeddings=32768, eos_token_id=151645,
                  pad_token_id=151643, bos_token_id=None)
QWEN25_15B = dict(QWEN25_05B, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  intermediate_size=8960)
QWEN25_3B = dict(QWEN25_05B, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                 intermediate_size=11008)
QWEN25_7B = dict(QWEN25_05B, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)
SHAPES = {"0.5b": QWEN25_05B, "1.5b": QWEN25_15B, "3b": QWEN25_3B, "7b": QWEN25_7B}
TINY = dict(QWEN25_05B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=1024, eos_token_id=1000, pad_token_id=1001)


def workload_model(quick: bool, device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                   shape: str = "0.5b"):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**(TINY if quick else SHAPES[shape]))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def word_tokenizer(config):
    """A fast tokenizer whose word `w<i>` is token i (EOS and pad named as Qwen2.5 names them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {config.eos_token_id: "<|im_end|>", config.pad_token_id: "<|endoftext|>"}
    vocab = {specials.get(i, f"w{i}"): i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="w0", padding_side="left")


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied embedding counted once


@torch.no_grad()
def calibrate_eos(model, hazard: float, seed: int = 0) -> dict:
    """Scale the EOS embedding row so that the mean per-token EOS probability is `hazard`."""
    config, device = model.config, model.device
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, config.vocab_size - 1000, (8, 256), generator=g).to(device)
    hidden = model.model(input_ids=ids).last_hidden_state.float().flatten(0, 1)  # (N, H), after the final norm
    embed = model.get_input_embeddings().weight
    eos = config.eos_token_id
    direction = embed[eos].float() / embed[eos].float().norm()
    score = hidden @ direction  # (N,)
    lse_rest, table = [], embed.float()
    for chunk in hidden.split(256):
        logits = chunk @ table.T
        logits[:, eos] = float("-inf")
        lse_rest.append(torch.logsumexp(logits, -1))
    lse_rest = torch.cat(lse_rest)
    mean_p = lambda beta: torch.sigmoid(beta * score - lse_rest).mean().item()  # noqa: E731
    lo, hi = 0.0, 1.0
    while mean_p(hi) < hazard:
        hi *= 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_p(mid) < hazard else (lo, mid)
    embed[eos] = (hi * direction).to(embed.dtype)
    return {"eos_beta": hi, "eos_hazard": mean_p(hi), "eos_score_std": score.std().item()}


def workload_prompts(num: int, lo: int, hi: int, vocab: int, eos: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (num,), generator=g).tolist()
    high = vocab - 1000 if vocab > 2000 else eos  # below the special tokens (EOS, pad)
    return [torch.randint(0, high, (n,), generator=g).tolist() for n in lengths]


def cuda_time(fn, warmup: int = 2, repeat: int = 5) -> float:
    """Median seconds of fn() measured with CUDA events (synchronised)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def capture_graph(step) -> torch.cuda.CUDAGraph:
    """A CUDA graph of step() (run once before, on a side stream: compilation, library workspaces)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def graph_seconds(step) -> float:
    """Median seconds of one replay of a CUDA graph that captures step()."""
    return cuda_time(capture_graph(step).replay, warmup=2, repeat=5)


def measure_ceilings() -> dict:
    """bf16 matmul rate (8192^3, random data) and device copy bandwidth (bytes read + written)."""
    mm_s, copy_s = _matmul_seconds(), _copy_seconds()
    torch.cuda.empty_cache()  # their inputs died with the helpers
    return {"bf16_matmul_tflops": 2 * 8192**3 / mm_s / 1e12, "copy_tb_s": 2 * 2**30 / copy_s / 1e12}


def _matmul_seconds() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return cuda_time(lambda: a @ b, warmup=3, repeat=10)


def _copy_seconds() -> float:
    src = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    return cuda_time(lambda: dst.copy_(src), warmup=3, repeat=10)


def machine() -> dict:
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,uuid,memory.total,driver_version,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, check=False)
        info["nvidia_smi"] = smi.stdout.strip()
    return info


def profile_kernels(fn, path: Path, rows: int = 35) -> str:
    """Run fn() under torch.profiler; the kernels by self device time, as a table (also written to path)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=90)
    Path(path).write_text(table)
    return table


KERNEL_KINDS = {  # kernel name fragments (lower case) -> a kind, first match wins
    "attention": ("flash", "fmha", "attention"), "gemm": ("gemm", "nvjet", "cutlass", "xmma", "cublas"),
    "optimizer": ("adam",), "nccl": ("nccl",), "compiled (triton)": ("triton",),
    "copy/fill/cast": ("copy", "memcpy", "memset", "fill", "cat", "elementwise", "vectorized", "reduce"),
}


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS.items() if any(p in low for p in parts)), "other")


def profile_phase(fn, path: Path, rows: int = 30):
    """Run fn() under torch.profiler: (its result, a summary). The summary gives the device's busy time (the
    union of kernel intervals, streams overlapped), kernel time by kind, and writes the top kernels and the
    top host ops (by self CPU time) to `path`. Profiling slows the host, so compare busy time with an
    unprofiled wall time of the same work."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    syncs: collections.Counter = collections.Counter()  # host waits for the device, by where they happen

    def record_sync(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):  # torch's sync debug warning; other warnings are not host waits
            syncs["".join(traceback.format_stack(limit=9)[:-2])] += 1

    sync()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record_sync
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            try:
                result = fn()
            finally:
                torch.cuda.set_sync_debug_mode(0) if cuda else None
            sync()  # inside: the profile keeps the kernels still queued
    wall = time.perf_counter() - start
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    busy, end, by_kind, by_name = 0.0, float("-inf"), {}, {}
    gaps: collections.Counter = collections.Counter()  # idle device time (us) by the kernels around it
    gap_counts: collections.Counter = collections.Counter()
    previous = ""
    for s, e, name in kernels:
        busy += max(0.0, e - max(s, end))
        if end > float("-inf") and s - end > 5:  # idle > 5 us before this kernel
            key = f"{previous[:50]} -> {name[:50]}"
            gaps[key] += s - end
            gap_counts[key] += 1
        if e > end:
            previous = name
        end = max(end, e)
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + (e - s) / 1e6
        total, calls = by_name.get(name, (0.0, 0))
        by_name[name] = (total + (e - s) / 1e3, calls + 1)
    summary = {"profiled_wall_s": wall, "device_busy_s": busy / 1e6, "device_idle_gaps_s": sum(gaps.values()) / 1e6,
               "kernels": len(kernels),
               "host_syncs": sum(syncs.values()),
               **{f"kernel_s/{k}": v for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}}
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[: 2 * rows]
    text = ["\n".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in summary.items()),
            "kernel ms | calls | kind | name\n" + "\n".join(
                f"{ms:9.2f} | {calls:6d} | {kernel_kind(name):18s} | {name[:160]}" for name, (ms, calls) in top),
            "device idle > 5 us, by the kernels before and after (us | gaps | kernels):\n" + "\n".join(
                f"{us:10.0f} | {gap_counts[key]:6d} | {key}" for key, us in gaps.most_common(rows)),
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=90),
            "host syncs by call stack:\n" + "\n".join(f"x{n}:\n{stack}" for stack, n in syncs.most_common())]
    Path(path).write_text("\n\n".join(text))
    return result, summary


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


class Results:
    """Sections of numbers, written (atomically) as JSON after every section, so a crash keeps the rest."""

    def __init__(self, name: str, out_dir: str | None):
        self.name = name
        self.out = Path(out_dir or os.environ.get("OUT") or "bench/results/raw")
        self.out.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, dict] = {}

    def add(self, section: str, values: dict) -> None:
        self.data.setdefault(section, {}).update(values)
        path = self.out / f"{self.name}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(path)
        print(f"[{section}] " + ", ".join(f"{k}={_fmt(v)}" for k, v in values.items()), flush=True)

    def attempt(self, section: str, fn, *args, **kwargs):
        """Run one measurement; if it raises, record the error under `section` and go on with the others
        (a benchmark run on a lent machine must not lose every figure to one failing variant)."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - recorded in the results and printed, never silent
            tail = "".join(traceback.format_exception(exc)[-6:])
            self.add(section, {"error": f"{type(exc).__name__}: {exc}"[:500], "traceback": tail[-3000:]})
            print(tail, flush=True)
            return None

    def table(self, rows: list[tuple[str, object, str]]) -> None:
        """Print the short table last: (figure, value, note)."""
        width = max(len(r[0]) for r in rows)
        print("\n" + "-" * 100)
        for name, value, note in rows:
            print(f"{name:<{width}}  {_fmt(value):>14}  {note}")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)
