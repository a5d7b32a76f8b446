"""The GPU benchmark of the whole GRPO step runs its CPU smoke mode (2 ranks, gloo, tiny model), so the
benchmark keeps up with the worker's API (it drives ActorRolloutWorker as the RL stage's driver does)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_worker_benchmark_quick_mode_runs_a_grpo_step_on_two_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "bench/gpu_worker.py", "--quick", "--warmup", "0", "--steps", "1", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu-worker-n2.json").read_text())
    step = results["step0"]
    assert step["sequences"] == 16 and step["local_tokens"] == step["tokens"]  # both ranks' rows, each once
    assert all(step[f"timing_s/{p}"] > 0 for p in ("gen", "old_log_prob", "update_actor", "sync"))
    assert step["rollout/logprob_diff_max"] < 1e-3  # the engines follow the trained weights
    assert step["global_seqlen/balanced_max"] <= step["global_seqlen/max"]
