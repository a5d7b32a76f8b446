"""The GRPO benchmark step through TRL's GRPOTrainer (issue 5): the baseline our step is compared with.

    python3 bench/gpu_trl.py [--out DIR] [--ours DIR/gpu-worker-n1.json]               # on the GPU machine
    PYTHONPATH=/tmp/trl-site:. .venv/bin/python bench/gpu_trl.py --quick               # CPU smoke test

The same workload as bench/gpu_worker.py at N=1 (--prompts 32): the Qwen2.5-0.5B shape with random weights and the EOS
logit calibrated to a 1/200 per-token hazard (bench/gpu_common.py), 32 prompts x 8 samples of 128-256
random tokens, temperature 1, up to 512 response tokens, the same cheap reward, and 2 optimizer steps per
256 generated sequences. TRL generates with transformers' `generate` (use_vllm=False, no vLLM here) and
trains with its own loop (accelerate, one process); the model is bf16 with bf16=True (TRL's usual setup:
lighter than our fp32 master weights). TRL counts an optimizer step per `gradient_accumulation_steps`
micro-batches of `per_device_train_batch_size` completions and generates once per `steps_per_generation`
micro-batches: 16 x 8 = 128 completions per optimizer step, 16 micro-batches (256 completions) per
generation, so one generation cycle (= one of our GRPO steps) is two TRL optimizer steps.

No hub: the tokenizer is a word-level one built here whose word `w<i>` is token i, so a prompt of random
token ids is the text of those words. Timing: wall time at each optimizer step's end (TrainerCallback,
after a CUDA synchronise); a cycle's time is the time of its two steps; the first `--warmup` cycles are not
counted. With `--ours` (bench/gpu_worker.py's N=1 JSON from the same machine run)
the ratio is written too. The EOS logit is calibrated on fp32 weights, which are then cast to bf16, as our
benchmarks do (an earlier version calibrated on the bf16 model: its responses came out ~20% longer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import (  # noqa: E402
    Results,
    calibrate_eos,
    machine,
    word_tokenizer,
    workload_model,
    workload_prompts,
)

STEPS_PER_CYCLE = 2  # optimizer steps per 256 generated sequences, as bench/gpu_worker.py's --minis 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model on CPU, short responses")
    p.add_argument("--out", default=None, help="folder for gpu-trl.json (default $OUT or bench/results/raw)")
    p.add_argument("--ours", default=None, help="bench/gpu_worker.py's gpu-worker-n1.json from the same machine")
    p.add_argument("--cycles", type=int, default=2, help="timed generation cycles (2 optimizer steps each)")
    p.add_argument("--warmup", type=int, default=1, help="untimed generation cycles first")
    args = p.parse_args(argv)
    if args.cycles < 1 or args.warmup < 0:
        p.error(f"--cycles={args.cycles} must be >= 1 and --warmup={args.warmup} >= 0")
    if args.ours and not Path(args.ours).is_file():
        p.error(f"--ours={args.ours}: no such file; run bench/gpu_worker.py first or leave --ours out")
    return args


def reward(completions, completion_ids, **_) -> list[float]:
    return [(len(ids) % 7) / 6 for ids in completion_ids]  # bench/gpu_worker.py's reward


class StepTimer:
    def __init__(self, res: Results, warmup_steps: int):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                timer.marks.append(timer.now())

            def on_step_end(self, args, state, control, **kwargs):
                timer.marks.append(timer.now())
                step_s = timer.marks[-1] - timer.marks[-2]
                timer.res.add(f"trl_step{state.global_step}", {"step_s": step_s,
                                                                "warmup": state.global_step <= warmup_steps})

        self.res, self.marks, self.callback = res, [], Callback()

    @staticmethod
    def now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()


def main(argv=None) -> None:
    args = parse_args(argv)
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    res = Results("gpu-trl", args.out)
    res.add("machine", {**machine(), "trl": trl.__version__})
    prompts_per_cycle, n, max_tokens = (4, 4, 16) if args.quick else (32, 8, 512)
    lo, hi = (8, 16) if args.quick else (128, 256)
    model = workload_model(args.quick, device, torch.float32)
    eos_info = calibrate_eos(model, hazard=1 / 200)
    model = model.to(torch.bfloat16 if device == "cuda" else torch.float32)
    config = model.config
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    tokenizer = word_tokenizer(config)
    cycles = args.warmup + args.cycles
    ids = workload_prompts(prompts_per_cycle * cycles, lo, hi, config.vocab_size, config.eos_token_id, seed=7)
    dataset = Dataset.from_dict({"prompt": [" ".join(f"w{i}" for i in p) for p in ids]})
    sequences = prompts_per_cycle * n
    micro = 16 if not args.quick else 4
    grad_accum = sequences // STEPS_PER_CYCLE // micro
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="gpu-trl-"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=grad_accum, steps_per_generation=grad_accum * STEPS_PER_CYCLE,
        num_generations=n, max_completion_length=max_tokens, temperature=1.0, learning_rate=1e-6, beta=0.0,
        num_iterations=1, max_steps=cycles * STEPS_PER_CYCLE, bf16=device == "cuda", use_cpu=device == "cpu",
        use_vllm=False, gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to=[],
        shuffle_dataset=False, seed=0, dataloader_num_workers=0,
    )
    res.add("config", {"device": device, "prompts_per_cycle": prompts_per_cycle, "n": n, "max_tokens": max_tokens,
                       "per_device_train_batch_size": micro, "gradient_accumulation_steps": grad_accum,
                       "steps_per_generation": grad_accum * STEPS_PER_CYCLE, "cycles": cycles, **eos_info})
    timer = StepTimer(res, args.warmup * STEPS_PER_CYCLE)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer.callback])
    trainer.train()
    step_s = [b - a for a, b in zip(timer.marks, timer.marks[1:])]
    timed = step_s[args.warmup * STEPS_PER_CYCLE :]
    cycle_s = [sum(timed[i : i + STEPS_PER_CYCLE]) for i in range(0, len(timed), STEPS_PER_CYCLE)]
    logged = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    summary = {"cycle_s": statistics.median(cycle_s), "cycle_s_all": cycle_s, "sequences_per_cycle": sequences,
               "seq_per_s": sequences / statistics.median(cycle_s),
               "completion_len_mean": statistics.mean(h["completions/mean_length"] for h in logged) if logged else None}
    rows = [(f"TRL GRPO step s ({sequences} sequences, {STEPS_PER_CYCLE} optimizer steps)", summary["cycle_s"],
             f"cycles {cycle_s}"),
            ("TRL sequences/s", summary["seq_per_s"], f"mean completion {summary['completion_len_mean']}")]
    if args.ours:
        ours = json.loads(Path(args.ours).read_text())["summary"]
        summary.update({"ours_step_s": ours["step_s"], "ours_seq_per_s": ours["seq_per_s"],
                        "speedup": summary["cycle_s"] / ours["step_s"] * ours["sequences_per_step"] / sequences})
        rows += [("ours GRPO step s (N=1)", ours["step_s"], f"{ours['sequences_per_step']} sequences"),
                 ("ours / TRL sequences per second", summary["speedup"], "target >= 5")]
    res.add("summary", summary)
    res.table(rows)


if __name__ == "__main__":
    main()
