"""The `cuda` engine on real architecture shapes against transformers, on one GPU (issue 17's architecture bar).

    python bench/gpu_arch_check.py --out DIR [--shapes qwen3-0.6b qwen3-8b llama3-8b]
    PYTHONPATH=. python bench/gpu_arch_check.py --quick --out DIR        # CPU, tiny shapes, fp32

For each shape: a model with random bf16 weights (seed 0; Qwen3: q/k norms and head_dim 128; Llama 3: rope scaling of
the llama3 kind, positions past `original_max_position_embeddings` reached), the cuda engine's greedy continuation of
8 prompts (64 tokens), then transformers' logprobs of exactly those tokens (teacher-forced, the trainer's
TokenLogprobs in bf16 and in fp32 master weights): the largest and the mean |engine - transformers| logprob, and the
share of the engine's greedy tokens that are transformers' argmax too. bf16 kernels differ in summation order, so
the bf16 figures are compared with the bf16 trainer's own gap to fp32 (printed beside them), not with zero.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.batch import build_batch  # noqa: E402
from stages.model.policy import TokenLogprobs  # noqa: E402
from stages.rollout.base import SamplingParams  # noqa: E402
from stages.rollout.cuda_engine import CudaRolloutEngine  # noqa: E402

QWEN3_06B = dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                 tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
QWEN3_8B = dict(QWEN3_06B, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=12288, tie_word_embeddings=False)
LLAMA3_8B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                 rms_norm_eps=1e-5, rope_theta=500_000.0, max_position_embeddings=131072,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64})  # 64 (8192 in Llama 3.1): prompts pass it
TINY = {"qwen3-tiny": dict(QWEN3_06B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, intermediate_size=128, vocab_size=512),
        "llama3-tiny": dict(LLAMA3_8B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=128, vocab_size=512)}
SHAPES = {"qwen3-0.6b": QWEN3_06B, "qwen3-8b": QWEN3_8B, "llama3-8b": LLAMA3_8B, **TINY}


def build(spec: dict, device: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {"max_position_embeddings": 40960, **spec}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec, eos_token_id=0, pad_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def check(name: str, device: str, quick: bool) -> dict:
    dtype = torch.float32 if quick else torch.bfloat16
    model = build(SHAPES[name], device, dtype)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, model.config.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(40, 120, (8,), generator=g)]
    engine = CudaRolloutEngine(model, eos_token_id=0, max_num_seqs=8, max_model_len=256, device=device,
                               dtype=dtype)
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_tokens=64, stop_token_ids=(-1,)))
    generate_s = time.perf_counter() - start
    del engine
    batch = build_batch([prompts[o.prompt_index] for o in outs], [o.response_ids for o in outs],
                        [o.logprobs for o in outs], pad_token_id=1)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.model_inputs().items()}
    mask, engine_lp = batch.response_mask, batch.tensors["rollout_logprobs"]
    result = {"shape": name, "generate_s": generate_s, "tokens": int(mask.sum())}
    with torch.no_grad():
        lp, _ = TokenLogprobs(model)(**inputs)  # the trainer in the engine's dtype
        result.update(gap(lp.float().cpu(), engine_lp, mask, "engine_vs_hf"))
        result["argmax_agree"] = argmax_agreement(model, inputs, batch)
        if not quick:  # the bf16 trainer's own gap to fp32 master weights: the scale bf16 differences have
            lp32, _ = TokenLogprobs(model.float())(**inputs)
            result.update(gap(lp.float().cpu(), lp32.float().cpu(), mask, "hf_bf16_vs_fp32"))
            result.update(gap(lp32.float().cpu(), engine_lp, mask, "engine_vs_fp32"))
    return result


def gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, name: str) -> dict:
    diff = (a - b).abs()[mask]
    return {f"{name}_max": float(diff.max()), f"{name}_mean": float(diff.mean())}


def argmax_agreement(model, inputs: dict, batch) -> float:
    """Share of the engine's greedy tokens that are transformers' argmax at the same place (teacher-forced)."""
    r = batch.num_response_tokens
    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                   position_ids=inputs["position_ids"]).logits[:, -r - 1:-1]
    agree = (logits.argmax(-1).cpu() == batch.tensors["input_ids"][:, -r:])[batch.response_mask]
    return float(agree.float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "qwen3-8b", "llama3-8b"])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    shapes, device = (list(TINY), "cpu") if args.quick else (args.shapes, "cuda")
    results = []
    for name in shapes:
        results.append(check(name, device, args.quick))
        print(json.dumps(results[-1]), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    (out / "arch_check.json").write_text(json.dumps({"device": gpu, "argv": sys.argv, "results": results}, indent=1))
    print(f"\n{gpu}: engine vs transformers on the engine's greedy tokens")
    print("| shape | tokens | max / mean |engine - hf| | max / mean |hf bf16 - fp32| | argmax agree |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        own = f"{r['hf_bf16_vs_fp32_max']:.3f} / {r['hf_bf16_vs_fp32_mean']:.4f}" if "hf_bf16_vs_fp32_max" in r else "-"
        print(f"| {r['shape']} | {r['tokens']} | {r['engine_vs_hf_max']:.3g} / {r['engine_vs_hf_mean']:.3g} | {own} | "
              f"{r['argmax_agree']:.3f} |")


if __name__ == "__main__":
    main()
