"""The RL stage's serial work on the driver per step, on the host's CPU: what grows with the number of ranks.

A synchronous step at N ranks gathers N ranks' rollout outputs, turns them into trajectories (decoding every
response), builds the padded batch, balances it, sends each rank its rows (twice: old_log_prob and the update) and
writes the rollout rows. The engines and trainers work in parallel; this part does not, so it is part of what keeps
weak scaling under N (bench/results/2026-11-27-gpu-x4-scale.md). Each part runs the stage's own functions on
synthetic outputs (`--per-rank` responses per rank, 100-511 tokens, prompts 40-119 tokens, groups of 8) with a
byte-level BPE tokenizer as Qwen's (8,000 tokens, trained here); Ray's transport is stood in for by pickling (what
Ray does to the arguments and results).

    PYTHONPATH=. .venv/bin/python bench/driver_cpu.py --ranks 1 4 --repeats 3 [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import random
import statistics
import time
from datetime import datetime, timezone

import torch

from infra.artifacts import code_version
from stages.agent.loops import LoopContext, Sample, SingleTurnLoop
from stages.batch import balance_batch
from stages.model.tiny import train_tokenizer
from stages.rl_data import rollout_batch, trajectory_rows
from stages.rollout.base import PackedOutputs, RolloutOutput, SamplingParams
from stages.workers.group import WorkerGroup

GROUP = 8  # samples per prompt


def tokenizer(seed: int = 0):
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(2, 10)))
             for _ in range(20_000)]
    return train_tokenizer([" ".join(rng.sample(words, 40)) + " 12+34=46" for _ in range(3_000)], 8_000)


def rank_outputs(rank: int, per_rank: int, vocab: int, rng: random.Random) -> list[RolloutOutput]:
    """One rank's outputs, prompt indices counting from 0 within its prompts (as the workers return them)."""
    outs = []
    for i in range(per_rank):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(100, 512))]
        outs.append(RolloutOutput(i // GROUP, ids, [-rng.random() for _ in ids], "stop"))
    return outs


class Prompts:
    """The PromptSet fields that rollout_batch reads."""

    def __init__(self, prompt_ids: list[list[int]]):
        n = len(prompt_ids)
        self.prompt_ids, self.data_sources = prompt_ids, ["bench"] * n
        self.ground_truths, self.extra_infos = ["46"] * n, [{}] * n


def sending_group(world: int) -> WorkerGroup:
    """The stage's WorkerGroup splitting code, with Ray's transport stood in for by pickling each rank's args."""
    group = object.__new__(WorkerGroup)
    group.world_size, group.sequence_parallel_size = world, 1
    group.call_each = lambda method, per_rank: [len(pickle.dumps(args)) for args in per_rank]
    return group


def one_step(world: int, per_rank: int, tok, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    prompts_per_rank = per_rank // GROUP
    prompt_ids = [[rng.randrange(len(tok)) for _ in range(rng.randrange(40, 120))]
                  for _ in range(world * prompts_per_rank)]
    # on the workers: what ActorRolloutWorker.generate returns
    sent = [pickle.dumps(PackedOutputs.pack(rank_outputs(r, per_rank, len(tok), rng))) for r in range(world)]
    times: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        times[name] = now - mark
        mark = now

    results = [pickle.loads(blob) for blob in sent]
    shards = [range(r * prompts_per_rank, (r + 1) * prompts_per_rank) for r in range(world)]
    outputs = PackedOutputs.concat(results, shards)  # as the stage's engine_generate
    lap("gather")
    ctx = LoopContext(lambda ids, params: outputs, tok, SamplingParams(n=GROUP))
    trajectories = SingleTurnLoop().run_batch(ctx, [Sample(i, p, [], {}) for i, p in enumerate(prompt_ids)])
    lap("trajectories")
    batch = rollout_batch(Prompts(prompt_ids), list(range(len(prompt_ids))), trajectories, "bench", 0)
    batch.tensors["scores"] = batch.tensors["rewards"] = torch.tensor([float(len(t.text) % 2) for t in trajectories])
    lap("build")
    batch, _ = balance_batch(batch, world, per_rank * world // 2)
    lap("balance")
    group = sending_group(world)
    for _ in range(2):  # old_log_prob and update_actor each send the rows
        group.split_call("update_actor", batch, per_rank * world // 2)
    lap("send x2")
    batch.tensors["old_logprobs"] = batch.tensors["advantages"] = batch.tensors["rollout_logprobs"]
    trajectory_rows(batch, ["prompt"] * len(batch), 0)
    lap("rows")
    times["total"] = sum(times.values())
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--per-rank", type=int, default=256, help="responses per rank (the worker bench's 256)")
    parser.add_argument("--repeats", type=int, default=3, help="steps per N; medians are reported")
    parser.add_argument("--out", help="write the medians and every step's times as JSON here")
    args = parser.parse_args()
    tok = tokenizer()
    one_step(1, GROUP * 2, tok, seed=0)  # imports and first calls out of the timings
    medians = {}
    for world in args.ranks:
        steps = [one_step(world, args.per_rank, tok, seed=s) for s in range(args.repeats)]
        medians[world] = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    parts = list(medians[args.ranks[0]])
    print(f"driver ms per step, median of {args.repeats} (commit {code_version()}, {torch.get_num_threads()} threads)")
    print(f"{'N':>3} " + " ".join(f"{p:>12}" for p in parts))
    for world, m in medians.items():
        print(f"{world:>3} " + " ".join(f"{m[p] * 1000:12.1f}" for p in parts))
    if args.out:
        record = {"commit": code_version(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "machine": f"{platform.node()} ({platform.processor() or platform.machine()})",
                  "threads": torch.get_num_threads(), "per_rank": args.per_rank, "repeats": args.repeats,
                  "median_s": medians}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
