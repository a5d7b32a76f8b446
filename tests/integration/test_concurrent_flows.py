"""Two flows started together with the same config on one store (a scheduled run and a manual one, say):
both complete, each keeps its own run id, config, evaluation rows and report, and the stage runs they share
are trained once (the second waits on the stage's lease, then takes the first's result): every RL step's
rollouts are in the store once."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from infra.sql import query
from tests.conftest import TINY_OVERRIDES

pytestmark = pytest.mark.slow
PROJECT = Path(__file__).resolve().parents[2]
STEPS, BATCH, N = 2, 8, 4


def test_two_identical_flows_at_once_share_work_and_keep_their_own_results(tmp_path):
    overrides = TINY_OVERRIDES + [
        f"storage.root={tmp_path / 'store'}", f"run.output_dir={tmp_path / 'out'}", "tracking.backends=[jsonl]",
        "rl.enabled=true", f"rl.total_steps={STEPS}", f"rl.train_batch_size={BATCH}", f"rl.rollout.n={N}",
        "rl.rollout.engine=hf", "rl.actor.ppo_mini_batch_size=4", "rl.test_freq=0", "rl.val_before_train=false",
        "rl.reward.num_workers=1", "ray.num_cpus=2", "data.max_response_length=24", "evaluate.engine=hf"]
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(tmp_path / "prefect" / "results")}
    flows = [subprocess.Popen([sys.executable, "-m", "flows.post_train", *overrides], cwd=PROJECT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [f.communicate(timeout=900)[0] for f in flows]
    assert [f.returncode for f in flows] == [0, 0], outputs
    run_ids = [re.search(r"^logs: \S+/runs/(\S+)/run\.log", out, re.M).group(1) for out in outputs]
    assert len(set(run_ids)) == 2
    store = tmp_path / "store"
    for run_id in run_ids:
        assert {p.name for p in (store / "runs" / run_id).iterdir()} == {"config.yaml", "report.html"}
        labels = query(str(store), f"SELECT DISTINCT label FROM evals WHERE run_id = '{run_id}' ORDER BY 1")
        assert [r["label"] for r in labels] == ["base", "rl", "sft"]
    counts = query(str(store), "SELECT run_id, step, count(*) AS n FROM rollouts GROUP BY 1, 2 ORDER BY 1, 2")
    assert [(r["step"], r["n"]) for r in counts] == [(s, BATCH * N) for s in range(1, STEPS + 1)]  # one RL run
    assert any("waiting for it to finish" in out for out in outputs)  # the second flow waited, and said so
    assert not list(store.glob("leases/*"))
