"""Kill the whole flow process (SIGKILL) during RL, rerun the same command: finished stages are cache
hits, RL resumes from its last checkpoint with the same data and learning rate, the store holds each
completed step's trajectories exactly once and no partial artifact, and the flow goes on to merge the final
checkpoint and evaluate base, SFT and RL (with the default engine: vLLM here)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.config import load_config
from infra.sql import query
from infra.store import ArtifactStore
from stages.model.optim import lr_multiplier
from tests.conftest import TINY_OVERRIDES

pytestmark = pytest.mark.slow
PROJECT = Path(__file__).resolve().parents[2]
STEPS, BATCH, N = 6, 8, 4


def overrides(tmp_path):
    return TINY_OVERRIDES + [
        f"storage.root={tmp_path / 'store'}", f"run.output_dir={tmp_path / 'out'}", "tracking.backends=[console]",
        "rl.enabled=true", f"rl.total_steps={STEPS}", f"rl.train_batch_size={BATCH}", f"rl.rollout.n={N}",
        "rl.actor.ppo_mini_batch_size=4", "rl.save_freq=2", "rl.test_freq=0", "rl.val_before_train=false",
        "rl.actor.optim.lr=1e-4", "rl.actor.optim.warmup_steps=4", "rl.actor.optim.lr_scheduler=cosine",
        "rl.reward.num_workers=1",
        "ray.num_cpus=2", "data.max_response_length=32",
    ]


def start(tmp_path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.post_train", *overrides(tmp_path)], cwd=PROJECT,
                            env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def prefect_states(tmp_path) -> dict[str, list[str]]:
    """Sorted state types of the flow runs and of the RL task runs in the runs' Prefect database."""
    code = ("import json; from prefect.client.orchestration import get_client\n"
            "with get_client(sync_client=True) as c:\n"
            "    rl = [r for r in c.read_task_runs() if r.name.startswith('rl')]\n"
            "    print(json.dumps({'flow': sorted(r.state_type.value for r in c.read_flow_runs()),\n"
            "                      'rl task': sorted(r.state_type.value for r in rl)}))")
    done = subprocess.run([sys.executable, "-c", code], env=env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def env(tmp_path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(PROJECT), "PREFECT_HOME": str(tmp_path / "prefect"),
            "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(tmp_path / "prefect" / "results")}


def wait_for_rollouts(store_root: Path, step: int, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    pattern = f"rollouts/run_id=*/step={step:08d}/part-0.parquet"
    while time.time() < deadline:
        if list(store_root.glob(pattern)):
            return
        if process.poll() is not None:
            raise AssertionError("flow ended before RL reached step %d:\n%s" % (step, process.stdout.read()))
        time.sleep(0.2)
    raise AssertionError(f"RL did not reach step {step} in {timeout} s")


def test_sigkill_during_rl_then_rerun_resumes(tmp_path):
    first = start(tmp_path)
    wait_for_rollouts(tmp_path / "store", 3, first)  # step 3 written; the last checkpoint is step 2
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert list((tmp_path / "out" / "runs").glob("*/tmp")), "the killed run's temporary folder"

    second = start(tmp_path)
    output, _ = second.communicate(timeout=900)
    assert second.returncode == 0, output
    assert "data-prep cached" in output and "sft cached" in output, output[-3000:]
    assert "rl completed, merge completed, evaluate-base completed" in output, output[-3000:]
    # The quiet console (vLLM engines in Ray workers here): no worker or INFO lines; those are in the run folder.
    assert "pid=" not in output and "| INFO" not in output and len(output.splitlines()) < 60, output
    run_log = Path(re.search(r"^logs: (\S+/run\.log)", output, re.M).group(1))
    assert "rl: resumed at step 2" in run_log.read_text()
    assert "rl: resumed at step 2" in output  # on the console too: a rerun that started over would show
    # the killed run no longer shows RUNNING in Prefect: the rerun marked it (and its RL task run) Crashed
    assert "marked 1 earlier flow runs Crashed" in output
    assert prefect_states(tmp_path) == {"flow": ["COMPLETED", "CRASHED"], "rl task": ["COMPLETED", "CRASHED"]}
    assert not list((tmp_path / "out" / "runs").glob("*/tmp")), "temporary folders of both runs are removed"
    assert "vLLM engine ready" in (run_log.parent / "workers" / "rl.log").read_text()

    root = str(tmp_path / "store")
    counts = query(root, "SELECT step, count(*) AS n, count(DISTINCT group_id) AS groups FROM rollouts "
                         "GROUP BY 1 ORDER BY 1")
    assert counts == [{"step": s, "n": BATCH * N, "groups": BATCH} for s in range(1, STEPS + 1)]
    # same learning rate as an uninterrupted run: the schedule's value at every step
    cfg = load_config(None, overrides(tmp_path))
    lrs = query(root, "SELECT step, value FROM metrics WHERE name = 'actor/lr' ORDER BY step")
    assert [r["step"] for r in lrs] == list(range(1, STEPS + 1))
    check_resumed_run(root, cfg, {r["step"]: r["value"] for r in lrs}, STEPS, BATCH)
    store = ArtifactStore(root)
    [merged] = store.versions("model", "rl")  # made by merge from the final checkpoint
    assert merged.inputs["checkpoint"].startswith("checkpoint/rl-") and merged.metadata["checkpoint_step"] == STEPS
    evals = query(root, "SELECT label, engine, value FROM evals WHERE data_source = 'all' AND metric = 'acc' "
                        "ORDER BY label")
    assert [(r["label"], r["engine"]) for r in evals] == [("base", "vllm"), ("rl", "vllm"), ("sft", "vllm")]
    assert all(0.0 <= r["value"] <= 1.0 for r in evals)


def check_resumed_run(root: str, cfg, lrs: dict[int, float], steps: int, batch: int) -> None:
    """What a resumed run shares with an uninterrupted one: each step's lr from the schedule, each step's prompts
    the sampler's, and every visible artifact version complete (the kill left none half-made)."""
    import pyarrow.parquet as pq

    from stages.rl_data import PromptSampler

    optim = cfg.rl.actor.optim
    for step in range(1, steps + 1):
        assert lrs[step] == pytest.approx(optim.lr * lr_multiplier(step - 1, optim, steps), rel=1e-9), step
    store = ArtifactStore(root)
    [dataset] = store.versions("dataset", "synthetic")
    questions = [row[-1]["content"] for row in pq.read_table(
        store.get_dir(dataset.ref) / "train.parquet", columns=["prompt"]).column("prompt").to_pylist()]
    sampler = PromptSampler(len(questions), batch, cfg.run.seed)
    for step in range(1, steps + 1):
        seen = {r["prompt"] for r in query(root, f"SELECT DISTINCT prompt FROM rollouts WHERE step = {step}")}
        assert seen == {questions[i] for i in sampler.indices(step)}, step
    for kind, name in store.artifacts():
        for manifest in store.versions(kind, name):
            folder = store.get_dir(manifest.ref)
            assert all((folder / f).stat().st_size == meta["size"] for f, meta in manifest.files.items())
