"""Multi-turn rollout throughput on one GPU: the `tool_agent` loop on the `cuda` engine beside single-turn.

    python bench/gpu_multiturn.py [--out DIR]                       # on the GPU machine
    PYTHONPATH=. .venv/bin/python bench/gpu_multiturn.py --quick    # CPU smoke test, tiny shapes

Workload: the Qwen2.5-0.5B shape with random bf16 weights (bench/gpu_common.py), 64 prompts of 128-256 tokens x
n=4 = 256 trajectories, 256 concurrent sequences.

- single_turn: one engine call, responses of exactly 3 x T model tokens (T = --turn-tokens, default 128).
- multi_turn: the `tool_agent` loop as the RL stage runs it (stages/agent/tool_loop.py: every trajectory a
  coroutine, generation requests batched by BatchedEngine, tools run concurrently): 3 model turns of T tokens,
  and between them 2 calls of a tool that sleeps `--latency` seconds (default 0.05) and answers 24 tokens.
  With prefix reuse (the engine keeps each finished turn's K/V, `prefix_cache_rows` = 256) and without (each
  turn's prompt, the whole conversation so far, is prefilled again).

A random model writes neither tool calls nor stop tokens, so both are scripted and said here: the parser
`bench_every_turn` reads every turn as one call of the tool `lookup`, and the engine is asked for at most T
tokens per call (a turn cut there is reported as finished, as a model that ends its turn there would be). The
model tokens are the same in both workloads (3 x T per trajectory); multi-turn adds 2 x 26 tool tokens per
trajectory that are prefilled, not generated.

Each workload runs once to compile and capture graphs, then `--repeats` times; the fastest is reported:
wall seconds, model tokens per second, engine calls and the seconds spent in them (the rest: tools and the
loop's own work), prefill and reused tokens. Writes gpu-multiturn.json
under --out (default $OUT) and prints a short table last.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import Results, machine, word_tokenizer, workload_model, workload_prompts  # noqa: E402
from infra.rl_config import MultiTurnConfig  # noqa: E402
from stages.agent import LoopContext, Sample, ToolAgentLoop  # noqa: E402
from stages.rollout.base import SamplingParams  # noqa: E402
from stages.rollout.cuda_engine import CudaRolloutEngine  # noqa: E402
from stages.tools.base import BaseTool, ToolCall, ToolFunction, ToolResponse, ToolSchema  # noqa: E402
from stages.tools.parsers import register_parser  # noqa: E402

TURNS, ANSWER_WORDS = 3, 24
CHAT_TEMPLATE = ("{% for m in messages %}w11 w12 {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}w11 w13 {% endif %}")


@register_parser("bench_every_turn")
def every_turn(text: str):
    return text, [ToolCall("lookup", {})], []


class SleepyLookup(BaseTool):
    """Answers ANSWER_WORDS words after `latency_s` seconds, as a remote tool would."""

    def __init__(self, latency_s: float):
        schema = ToolSchema(function=ToolFunction(name="lookup", description="bench tool"))
        super().__init__({}, schema)
        self.latency_s = latency_s

    async def execute(self, instance_id, parameters, **kwargs) -> ToolResponse:
        await asyncio.sleep(self.latency_s)
        return ToolResponse(" ".join(f"w{100 + i}" for i in range(ANSWER_WORDS)))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="tiny model and workload (CPU smoke test)")
    p.add_argument("--out", default=None)
    p.add_argument("--turn-tokens", type=int, default=128)
    p.add_argument("--latency", type=float, default=0.05)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    return p.parse_args()


class CountingEngine:
    """The engine's generate capped at T tokens per call, with its calls and prefill counts summed."""

    def __init__(self, engine: CudaRolloutEngine, turn_tokens: int):
        self.engine, self.turn_tokens = engine, turn_tokens
        self.totals = {"calls": 0, "prefill_tokens": 0, "reused_tokens": 0, "engine_s": 0.0}

    def generate(self, prompt_ids, params):
        cap = min(params.max_tokens, self.turn_tokens)
        start = time.perf_counter()
        outs = self.engine.generate(prompt_ids, replace(params, max_tokens=cap))
        self.totals["engine_s"] += time.perf_counter() - start
        self.totals["calls"] += 1
        for key in ("prefill_tokens", "reused_tokens"):
            self.totals[key] += self.engine.stats[key]
        return [replace(o, finish_reason="stop") if cap < params.max_tokens else o for o in outs]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def single_turn(counting: CountingEngine, prompts, n: int, turn_tokens: int) -> dict:
    params = SamplingParams(n=n, temperature=1.0, max_tokens=TURNS * turn_tokens, stop_token_ids=(-1,), seed=0)
    counting.turn_tokens = TURNS * turn_tokens
    outs = counting.generate(prompts, params)
    return {"model_tokens": sum(len(o.response_ids) for o in outs), "tool_tokens": 0}


def multi_turn(counting: CountingEngine, prompts, n: int, turn_tokens: int, tokenizer, tool) -> dict:
    budget = TURNS * turn_tokens + (TURNS - 1) * (ANSWER_WORDS + 8)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=budget, stop_token_ids=(-1,), seed=0)
    options = MultiTurnConfig(format="bench_every_turn", max_assistant_turns=TURNS, max_user_turns=TURNS,
                              max_tool_response_length=10_000)
    ctx = LoopContext(counting.generate, tokenizer, params, {"lookup": tool}, options)
    samples = [Sample(i, p, [{"role": "user", "content": ""}], {}) for i, p in enumerate(prompts)]
    trajectories = ToolAgentLoop().run_batch(ctx, samples)
    model = sum(sum(t.response_mask) for t in trajectories)
    return {"model_tokens": model, "tool_tokens": sum(len(t.response_ids) for t in trajectories) - model,
            "turns_per_trajectory": sum(len(t.turns) for t in trajectories) / len(trajectories)}


def measure(name: str, run, engine: CudaRolloutEngine, turn_tokens: int, repeats: int) -> dict:
    best = None
    for attempt in range(repeats + 1):  # the first compiles and captures graphs
        counting = CountingEngine(engine, turn_tokens)
        engine.update_weights(engine_weights)  # empties the park: each attempt starts cold
        sync()
        start = time.perf_counter()
        figures = run(counting)
        sync()
        wall = time.perf_counter() - start
        row = {"wall_s": wall, "tokens_per_s": figures["model_tokens"] / wall, **figures, **counting.totals}
        print(f"{name} attempt {attempt}: {row}", flush=True)
        if attempt and (best is None or wall < best["wall_s"]):
            best = row
    return best


engine_weights: dict = {}


def main() -> None:
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if args.quick:
        args.prompts, args.n, args.turn_tokens, args.repeats = 4, 2, 8, 1
    results = Results("gpu-multiturn", args.out)
    results.add("machine", machine())
    model = workload_model(args.quick, device, torch.bfloat16 if device == "cuda" else torch.float32)
    tokenizer = word_tokenizer(model.config)
    tokenizer.chat_template = CHAT_TEMPLATE
    engine_weights.update({k: v.clone() for k, v in model.state_dict().items()})
    prompts = workload_prompts(args.prompts, 128 if not args.quick else 8, 256 if not args.quick else 16,
                               model.config.vocab_size, model.config.eos_token_id)
    seqs = args.prompts * args.n
    max_len = 256 + TURNS * args.turn_tokens + (TURNS - 1) * (ANSWER_WORDS + 8) + 8
    workload = {"prompts": args.prompts, "n": args.n, "turn_tokens": args.turn_tokens, "turns": TURNS,
                "tool_latency_s": args.latency, "tool_answer_words": ANSWER_WORDS, "device": device}
    results.add("workload", workload)
    tool = SleepyLookup(args.latency)
    rows = {}
    for name, cache_rows in (("single_turn", 0), ("multi_turn_reuse", seqs), ("multi_turn_no_reuse", 0)):
        engine = CudaRolloutEngine(model, model.config.eos_token_id, max_num_seqs=min(seqs, 256),
                                   max_model_len=max_len, prefix_cache_rows=cache_rows)
        if name == "single_turn":
            run = lambda c: single_turn(c, prompts, args.n, args.turn_tokens)  # noqa: E731
        else:
            run = lambda c: multi_turn(c, prompts, args.n, args.turn_tokens, tokenizer, tool)  # noqa: E731
        rows[name] = results.attempt(name, measure, name, run, engine, args.turn_tokens, args.repeats)
        if rows[name]:
            results.add(name, rows[name])
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    base = rows.get("single_turn")
    table = []
    for name, row in rows.items():
        if row:
            ratio = f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x single-turn" if base else ""
            table.append((f"{name} tokens/s", f"{row['tokens_per_s']:.0f}", f"{row['wall_s']:.2f} s; {ratio}"))
            table.append((f"{name} prefill/reused", f"{row['prefill_tokens']}/{row['reused_tokens']}",
                          f"{row['calls']} engine calls, {row['engine_s']:.2f} s in them"))
    results.table(table)


if __name__ == "__main__":
    main()
