"""Synchronous vs one-step off-policy vs fully async RL on the demo task, side by side on the same devices (one run).

    PYTHONPATH=. .venv/bin/python bench/async_cpu.py [--seeds 0 1] [--steps 12] [--target 0.9] [--from DIR]
    PYTHONPATH=. python bench/async_cpu.py --gpu --devices 2 --set rl.rollout.engine=cuda ...   # 2 GPUs (issue 18:
        needs Ray (carried in two halves), duckdb and this project's other CPU packages on the GPU machine)

SFT once per seed (the demo recipe, `recipes/demo.yaml`; `--from` reuses the data and SFT model of an earlier run,
as bench/rl_learning.py's FROM does), then RL from it in each variant, each cold (its own store, its own Ray
cluster of the machine's cores): every variant uses the same two CPU slots, so the colocated loop's one worker has
both cores and a separate trainer and rollout worker have one each. Validation (greedy, `--val` prompts) every 2
steps gives the held-out accuracy; its time is left out of the figures (it pauses the asynchronous producer).

Per variant and seed: steps per minute of training (RL wall time without validation and start-up), tokens (prompt +
response, from `rollouts`) per second of the steps after the first (over the step times, and over the wall time
with validation's own work left out), time to the
first validation at `--target` held-out accuracy (the demo reaches 97.5% at step 10), the last validation
accuracy, the mean rollout score of the first and last 3 steps, and staleness (SQL over `rollouts`).
Prints a table last; writes JSON and a markdown table to --out (default bench/results/<date>-async-cpu.*).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from infra.checkpoints import StoreCheckpoints
from infra.config import load_config
from infra.sql import query
from infra.store import ArtifactStore
from infra.tracking import Tracker
from infra.trajectories import RunTables


def variants(devices: int, gpu: bool) -> dict[str, list[str]]:
    """Each variant on `devices` devices in all: colocated on all of them (on CPU one worker, with every core's
    threads, as the demo runs), or half of them training and half generating."""
    trainers = devices // 2
    colocated = [f"ray.num_devices_per_node={devices if gpu else 1}"]
    separate = [f"ray.num_devices_per_node={trainers}", f"ray.rollout_devices_per_node={devices - trainers}"]
    tis = "rl.algorithm.rollout_correction.rollout_is=token"
    one_step = [*separate, "rl.async_training.mode=one_step_off"]
    fully = [*separate, "rl.async_training.mode=fully_async", "rl.async_training.generation_groups=16",
             "rl.async_training.max_staleness=1", "rl.async_training.partial_rollout_tokens=16"]
    return {"sync colocated": colocated, "sync separate": separate,
            "one-step off": one_step, "one-step off + TIS": [*one_step, tis], "fully async": fully,
            "fully async + TIS": [*fully, tis],
            "fully async + bypass": [*fully, "rl.algorithm.rollout_correction.bypass_mode=true"]}


def prepare(cfg, folder: Path) -> None:
    from bench.rl_learning import prepare as sft

    sft(cfg, folder)


def run_variant(recipe: str, base: list[str], overrides: list[str], folder: Path, store_dir: Path) -> dict:
    from stages.rl import run_rl

    cfg = load_config(recipe, base + overrides)
    shutil.rmtree(store_dir, ignore_errors=True)
    store = ArtifactStore(str(store_dir))
    start = time.time()  # run_rl starts and stops its own local Ray cluster (ray.num_cpus slots)
    run_rl(cfg, str(folder / "sft"), folder / "data", StoreCheckpoints(store, "bench", 1), RunTables(store, "bench"),
           Tracker([]))
    return summarize(str(store_dir), start, time.time())


def summarize(root: str, start: float, end: float) -> dict:
    def series(name: str) -> dict[int, float]:
        return {r["step"]: r["value"] for r in query(root, f"SELECT step, value FROM metrics WHERE name = '{name}'")}

    step_s, testing = series("timing_s/step"), series("timing_s/testing")
    graphs = series("perf/compiled_graphs")  # torch.compile's graphs so far: a rise after step 1 is a recompile
    acc = {s: v for s, v in series("val/acc/mean@1").items() if s > 0}
    stamps = {r["step"]: r["t"] for r in query(root, "SELECT step, epoch(max(time)) AS t FROM metrics GROUP BY 1")}
    first_stamp = min(stamps.values())
    train_s = sum(step_s.values())
    first = min(step_s)
    steady = [v for s, v in step_s.items() if s > first]  # the first step compiles (GPU: ~20 s)
    scores = [r["s"] for r in query(root, "SELECT step, avg(score) AS s FROM rollouts GROUP BY 1 ORDER BY 1")]
    tokens = {r["step"]: r["n"] for r in query(root, "SELECT step, sum(num_prompt_tokens + num_response_tokens) "
                                                     "AS n FROM rollouts GROUP BY 1")}
    steady_tokens = sum(n for s, n in tokens.items() if s > first)
    # wall time from step 1's end to the last step's, validation's own work left out: this also counts what no
    # step timer holds (the separate modes' wait for the producer's chunk before a validation; the table writes)
    wall = max(stamps.values()) - stamps[first] - sum(v for s, v in testing.items() if s > first)
    stale = query(root, "SELECT avg(staleness) AS mean, max(staleness) AS max, avg(CASE WHEN policy_version <> "
                        "policy_version_max THEN 1 ELSE 0 END) AS partial FROM rollouts")[0]
    return {"steps": len(step_s), "train_s": train_s, "steps_per_min": 60 * len(step_s) / train_s,
            "steps_per_min_after_first": 60 * len(steady) / sum(steady) if steady else float("nan"),
            "tokens_per_s_after_first": steady_tokens / sum(steady) if steady else float("nan"),
            "tokens_per_s_wall_after_first": steady_tokens / wall if steady else float("nan"),
            "tokens_per_step": tokens, "rl_wall_s": end - start,
            "startup_s": first_stamp - start - step_s[first],
            "acc": acc, "step_s": step_s, "testing_s": testing, "stamps": stamps, "scores": scores,
            "compiled_graphs": graphs,
            "recompiles_after_first": max(graphs.values()) - graphs[first] if graphs else None,
            "staleness_mean": stale["mean"], "staleness_max": stale["max"], "partial_frac": stale["partial"]}


def time_to(result: dict, target: float) -> float | None:
    """Training seconds (steps only, validation left out) until the first validation at `target` accuracy."""
    for step in sorted(result["acc"]):
        if result["acc"][step] >= target:
            return sum(v for s, v in result["step_s"].items() if s <= step)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--val", type=int, default=100, help="held-out prompts per validation")
    parser.add_argument("--variants", nargs="+", default=list(variants(2, False)))
    parser.add_argument("--devices", type=int, default=2, help="devices in all (CPU slots, or GPUs with --gpu)")
    parser.add_argument("--gpu", action="store_true", help="GPUs: colocated on every GPU, no ray.num_cpus")
    parser.add_argument("--recipe", default="recipes/demo.yaml")
    parser.add_argument("--set", nargs="*", default=[], help="more overrides for every run (e.g. "
                        "rl.rollout.engine=cuda model.path=...)")
    parser.add_argument("--from", dest="source", help="folder of an earlier run (data/, sft/ per seed-N)")
    parser.add_argument("--work", default="/tmp/async-bench")
    parser.add_argument("--out", default=f"bench/results/{date.today()}-async-cpu")
    args = parser.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # before the first variant, not after it
    work = Path(args.source or args.work)
    results = []
    for seed in args.seeds:
        base = [f"run.seed={seed}", f"rl.total_steps={args.steps}", "rl.test_freq=2", "rl.save_freq=0",
                f"rl.max_validation_samples={args.val}", "rl.val_before_train=false", *args.set,
                *([] if args.gpu else [f"ray.num_cpus={args.devices}"])]
        plans = variants(args.devices, args.gpu)
        folder = work / f"seed-{seed}"
        if not (folder / "sft").exists():
            prepare(load_config(args.recipe, base + ["sft.save_freq=100000"]), folder)
        for name in args.variants:
            result = run_variant(args.recipe, base, plans[name], folder, folder / f"store-{name.replace(' ', '_')}")
            result.update(variant=name, seed=seed, overrides=plans[name],
                          time_to_target_s=time_to(result, args.target))
            results.append(result)
            print(json.dumps({k: result[k] for k in ("variant", "seed", "steps_per_min", "steps_per_min_after_first",
                                                     "tokens_per_s_after_first", "tokens_per_s_wall_after_first",
                                                     "recompiles_after_first", "time_to_target_s",
                                                     "staleness_mean")}), flush=True)
            write(results, args)  # after every variant: a later failure keeps the finished ones


def command_python() -> str:
    """The interpreter as a reader would type it (.venv/bin/python in this checkout, else its name: python3), after
    the environment that changes the run (PYTHONPATH, OMP_NUM_THREADS) where set."""
    exe = Path(sys.executable).absolute()
    python = str(exe.relative_to(Path.cwd())) if exe.is_relative_to(Path.cwd()) else exe.name
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in ("OMP_NUM_THREADS", "PYTHONPATH") if os.environ.get(k)]
    return " ".join([*env, python])


def write(results: list[dict], args) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    machine = f"{platform.machine()}, {platform.processor() or 'cpu'}, {len(os.sched_getaffinity(0))} cores"
    if args.gpu:
        import torch

        machine += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    command = f"{command_python()} {shlex.join(sys.argv)}"
    Path(args.out + ".json").write_text(json.dumps({"command": command, "commit": commit, "machine": machine,
                                                    "date": str(date.today()), "results": results}, indent=1,
                                                   default=str))
    sync = {r["seed"]: r["steps_per_min_after_first"] for r in results if r["variant"] == "sync colocated"}
    lines = ["| variant | seed | steps/min | after step 1 | ratio to sync colocated (after step 1) | "
             "tokens/s after step 1 (steps; wall) | time to target (s) | last val acc | score first 3 -> last 3 | "
             "staleness mean / max | samples across a push |",
             "|" + " --- |" * 11]
    for r in results:
        last = r["acc"][max(r["acc"])] if r["acc"] else float("nan")
        ratio = f"{r['steps_per_min_after_first'] / sync[r['seed']]:.2f}x" if r["seed"] in sync else "-"
        first3, last3 = sum(r["scores"][:3]) / 3, sum(r["scores"][-3:]) / 3
        ttt = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        lines.append(f"| {r['variant']} | {r['seed']} | {r['steps_per_min']:.1f} | "
                     f"{r['steps_per_min_after_first']:.1f} | {ratio} | "
                     f"{r['tokens_per_s_after_first']:,.0f}; {r['tokens_per_s_wall_after_first']:,.0f} | {ttt} | "
                     f"{last:.3f} | "
                     f"{first3:.3f} -> {last3:.3f} | {r['staleness_mean']:.2f} / {r['staleness_max']} | "
                     f"{r['partial_frac']:.2f} |")
    table = "\n".join(lines)
    Path(args.out + ".md").write_text(f"Command: `{command}`\nCommit {commit}, {machine}, {date.today()}\n\n"
                                      f"{table}\n")
    print(table)


if __name__ == "__main__":
    main()
