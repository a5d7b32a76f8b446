"""The calculator recipe through the whole flow, for several seeds (CPU): does RL learn to use the tool?

    PYTHONPATH=. .venv/bin/python bench/tool_calc.py [SEED ...] [-- KEY=VALUE ...]     # default seeds 0 1 2

Each seed is one cold `python -m flows.post_train recipes/tool_calc.yaml run.seed=S` in its own output folder
and store under bench/out/tool_calc/ (the flow's console goes to <folder>/console.txt). Prints one table row per
seed: held-out accuracy of base, SFT and RL (the evaluation stage: vLLM, greedy, the tool_agent loop), the share
of rollouts with a correct tool call (the calculator answered and the final answer was right) at the first and
the last RL step, tool calls per rollout at the first and last step, and the wall time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from infra.sql import query

OUT = Path("bench/out/tool_calc")


def run_seed(seed: int, overrides: list[str]) -> dict:
    folder = OUT / f"seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    root = str(folder / "store")
    command = [sys.executable, "-m", "flows.post_train", "recipes/tool_calc.yaml", f"run.seed={seed}",
               f"run.output_dir={folder}", f"storage.root={root}", *overrides]
    start = time.monotonic()
    with open(folder / "console.txt", "w") as console:
        done = subprocess.run(command, stdout=console, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": "."})
    took = time.monotonic() - start
    if done.returncode:
        raise SystemExit(f"seed {seed} failed (rc {done.returncode}); see {folder / 'console.txt'}")
    acc = {r["label"]: r["value"] for r in query(root, "SELECT label, value FROM evals WHERE data_source = 'all' "
                                                       "AND metric = 'acc'")}
    steps = query(root, "SELECT step, avg(num_tool_calls) AS calls, avg(CASE WHEN num_tool_calls > 0 AND "
                        "num_tool_errors = 0 AND score >= 1 THEN 1 ELSE 0 END) AS correct_calls FROM rollouts "
                        "GROUP BY 1 ORDER BY 1")
    return {"seed": seed, **acc, "first": steps[0], "last": steps[-1], "time_s": took}


def main(argv: list[str]) -> None:
    seeds = [int(a) for a in (argv[: argv.index("--")] if "--" in argv else argv)] or [0, 1, 2]
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    print("| seed | base | SFT | RL | RL - SFT | correct tool calls, step 1 -> last | calls per rollout | time |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for seed in seeds:
        r = run_seed(seed, overrides)
        print(f"| {seed} | {100 * r['base']:.1f}% | {100 * r['sft']:.1f}% | {100 * r['rl']:.1f}% | "
              f"{100 * (r['rl'] - r['sft']):+.1f} | {r['first']['correct_calls']:.2f} -> "
              f"{r['last']['correct_calls']:.2f} | {r['first']['calls']:.2f} -> {r['last']['calls']:.2f} | "
              f"{r['time_s']:.0f} s |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
