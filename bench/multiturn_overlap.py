"""Does a sample's tool latency overlap the other samples' generation? (CPU, hf engine, the tool_agent loop)

    PYTHONPATH=. .venv/bin/python bench/multiturn_overlap.py MODEL_DIR DATA_DIR [NUM_PROMPTS] [LATENCY_S]

MODEL_DIR: a model that calls the calculator (e.g. the merged RL model of recipes/tool_calc.yaml,
`outputs/store/artifacts/model/rl/<version>`); DATA_DIR: its dataset folder (validation.parquet). The calculator
gets 0 and then `LATENCY_S` (default 0.05) of extra latency per call, as a remote tool would. For each, two runs
over the same prompts, greedy: all samples at once (the loop's coroutines, generation batched by BatchedEngine)
and one sample at a time (a loop without concurrency). Prints one JSON line: wall times, engine calls, tool
calls, and what the latency added to the wall time in each mode (without overlap: about calls x latency).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from infra.config import load_config
from infra.rl_config import MultiTurnConfig
from stages.agent import LoopContext, Sample, ToolAgentLoop
from stages.data_prep import load_prompts
from stages.model.loading import load_model, load_tokenizer
from stages.rollout.base import SamplingParams
from stages.rollout.hf import HFRolloutEngine
from stages.tools.base import ToolResponse
from stages.tools.calculator import CalculatorTool


class SlowCalculator(CalculatorTool):
    def __init__(self, latency_s: float):
        super().__init__()
        self.latency_s = latency_s

    async def execute(self, instance_id, parameters, **kwargs) -> ToolResponse:
        await asyncio.sleep(self.latency_s)
        return await super().execute(instance_id, parameters, **kwargs)


def main(argv: list[str]) -> None:
    model_dir, data_dir = Path(argv[0]), Path(argv[1])
    num = int(argv[2]) if len(argv) > 2 else 64
    latency = float(argv[3]) if len(argv) > 3 else 0.05
    cfg = load_config("recipes/tool_calc.yaml", [])
    tokenizer = load_tokenizer(model_dir)
    engine = HFRolloutEngine(load_model(model_dir, cfg.model, trainable=False), tokenizer.pad_token_id,
                             tokenizer.eos_token_id, batch_size=num)
    prompts = load_prompts(data_dir / "validation.parquet", tokenizer, cfg.data)
    samples = [Sample(i, prompts.prompt_ids[i], prompts.prompts[i], prompts.extra_infos[i]) for i in range(num)]
    calls: list[int] = []

    def generate(ids, params):
        calls.append(len(ids))
        return engine.generate(ids, params)

    params = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.data.max_response_length, seed=0)
    loop, result = ToolAgentLoop(), {"num_prompts": num, "tool_latency_s": latency}
    for delay in (0.0, latency):
        ctx = LoopContext(generate, tokenizer, params, {"calculator": SlowCalculator(delay)},
                          MultiTurnConfig(max_assistant_turns=3, max_user_turns=2))
        for name, batches in (("concurrent", [samples]), ("one_at_a_time", [[s] for s in samples])):
            calls.clear()
            start = time.perf_counter()
            trajectories = [t for batch in batches for t in loop.run_batch(ctx, batch)]
            key = f"{name}_latency{delay:g}"
            result[f"{key}_s"] = time.perf_counter() - start
            result[f"{key}_engine_calls"] = len(calls)
            result[f"{key}_tool_calls"] = sum(t.metrics.get("tool/calls", 0) for t in trajectories)
    # what the tools' latency added to the wall time, in each mode (one at a time: about tool calls x latency)
    for name in ("concurrent", "one_at_a_time"):
        result[f"{name}_added_by_latency_s"] = result[f"{name}_latency{latency:g}_s"] - result[f"{name}_latency0_s"]
    result["tool_calls_x_latency_s"] = result[f"concurrent_latency{latency:g}_tool_calls"] * latency
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
