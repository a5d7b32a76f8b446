"""How much RL improves held-out accuracy on the synthetic task (CPU): SFT once, then RL, then greedy eval.

    PYTHONPATH=. .venv/bin/python bench/rl_learning.py [KEY=VALUE ...]          # SFT + RL
    FROM=/path/printed/before PYTHONPATH=. .venv/bin/python bench/rl_learning.py ...   # reuse data + SFT model
    RECIPE=other.yaml ...                                                           # default recipes/demo.yaml

Prints one JSON line: SFT and RL held-out accuracy (greedy), the mean rollout score per step, timings.
Runs the stages directly (no Prefect) on the recipe plus the overrides; RL uses a local Ray cluster with
vLLM rollouts.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from infra.checkpoints import StoreCheckpoints
from infra.config import load_config
from infra.sql import query
from infra.store import ArtifactStore
from infra.tracking import Tracker
from infra.trajectories import RunTables
from stages.data_prep import corpus_texts, run_data_prep
from stages.evaluate import evaluate_model
from stages.merge import checkpoint_metadata, merge_checkpoint, merge_source
from stages.model.tiny import build_tiny_model
from stages.rl import run_rl
from stages.sft import run_sft


class NoCheckpoints:  # SFT only: RL's output is its final checkpoint, kept in the store
    tmp_dir = None

    def latest(self):
        return None

    def save(self, step, local_dir):
        pass


def prepare(cfg, folder: Path) -> None:
    run_data_prep(cfg.data, cfg.run.seed, folder / "data")
    build_tiny_model(cfg.model.tiny, corpus_texts(folder / "data"), cfg.run.seed, folder / "base")
    run_sft(cfg, folder / "base", folder / "data", folder / "sft", NoCheckpoints(), Tracker([]))


def main(overrides: list[str]) -> None:
    cfg = load_config(os.environ.get("RECIPE", "recipes/demo.yaml"),
                      overrides + ["rl.enabled=true", "ray.num_cpus=2", "rl.val_before_train=false",
                                   "sft.save_freq=100000"])
    start = time.time()
    folder = Path(os.environ["FROM"]) if os.environ.get("FROM") else Path(tempfile.mkdtemp())
    if not os.environ.get("FROM"):
        prepare(cfg, folder)
    shutil.rmtree(folder / "store", ignore_errors=True)
    validation = folder / "data" / "validation.parquet"
    acc_sft = evaluate_model(cfg, folder / "sft", validation).metrics["acc"]
    sft_s, start = time.time() - start, time.time()
    store = ArtifactStore(str(folder / "store"))
    checkpoints = StoreCheckpoints(store, "bench", 1, {"init_model": str(folder / "sft")},
                                   checkpoint_metadata(cfg.model))
    result = run_rl(cfg, str(folder / "sft"), folder / "data", checkpoints, RunTables(store, "bench"), Tracker([]))
    rl_s = time.time() - start
    shutil.rmtree(folder / "rl", ignore_errors=True)
    merge_checkpoint(merge_source(store, result.checkpoint), folder / "rl")  # the RL model, as the flow makes it
    acc_rl = evaluate_model(cfg, folder / "rl", validation).metrics["acc"]
    scores = query(str(folder / "store"), "SELECT step, avg(score) AS s FROM rollouts GROUP BY 1 ORDER BY 1")
    print(json.dumps({"overrides": overrides, "folder": str(folder), "sft_s": round(sft_s), "rl_s": round(rl_s),
                      "acc_sft": acc_sft, "acc_rl": acc_rl, "scores": [round(r["s"], 3) for r in scores]}))


if __name__ == "__main__":
    main(sys.argv[1:])
