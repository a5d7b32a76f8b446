"""A persistent Ray head started with `python -m infra.cluster up`, used by two flow runs in a row through
`ray.address`: both attach to it (no Ray of their own), leave no actor or placement group behind, and the
head keeps running until `down`, which stops every process of it and nothing else."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from infra.cluster import ClusterState, session_members
from tests.conftest import free_port

pytestmark = pytest.mark.slow
PROJECT = Path(__file__).resolve().parents[2]

RUN = ["data.synthetic.num_train=256", "data.synthetic.num_validation=32", "data.synthetic.max_operand=9",
       "model.tiny.hidden_size=128", "model.tiny.intermediate_size=256", "data.max_response_length=16",
       "sft.enabled=false", "rl.enabled=true", "rl.train_batch_size=8", "rl.rollout.n=2",
       "rl.actor.ppo_mini_batch_size=4", "rl.rollout.engine=hf", "rl.test_freq=0", "rl.val_before_train=false",
       "rl.reward.num_workers=1", "evaluate.engine=hf", "evaluate.max_samples=8", "tracking.backends=[jsonl]"]

# What the cluster's GCS recorded (drivers, actors, placement groups). Ray's state API would need the
# dashboard, which needs ray[default] extras that are not in the lock; ray._private.state reads the GCS.
INSPECT = """
import json, sys, ray
from ray._private import state
from infra.cluster import attach_auth
attach_auth()
ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
jobs = [{"entrypoint": j.get("Entrypoint", ""), "dead": j["IsDead"]} for j in state.jobs()]
actors = [{"cls": a["ActorClassName"], "state": a["State"]} for a in state.actors().values()]
groups = [g["state"] for g in state.state.placement_group_table().values()]
print(json.dumps({"jobs": jobs, "actors": actors, "groups": groups}))
ray.shutdown()
"""


def cli(state_dir: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cluster", "--state-dir", str(state_dir), *args], cwd=PROJECT,
                          env={**os.environ, "PYTHONPATH": str(PROJECT)}, capture_output=True, text=True,
                          timeout=timeout)



@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A head node on free ports with 2 CPUs; Ray's temp dir is short (its socket paths have a length limit)."""
    state_dir = tmp_path_factory.mktemp("ray-state")
    temp_dir = tempfile.mkdtemp(prefix="rlr-")
    done = cli(state_dir, "up", "--port", str(free_port()), "--num-cpus", "2", "--temp-dir", temp_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    state = ClusterState.read(state_dir)
    try:
        yield state_dir, state, done.stdout
    finally:
        if ClusterState.read(state_dir):
            cli(state_dir, "down")
        for pid in session_members(state.pid):  # only if down failed: this head's processes, nothing else
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


def run_flow(tmp_path: Path, address: str, *extra: str) -> str:
    """A flow run attached to `address`; -> its console output and run.log."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(tmp_path / "prefect" / "results")}
    overrides = [*RUN, f"storage.root={tmp_path / 'store'}", f"run.output_dir={tmp_path / 'out'}",
                 f"ray.address={address}", *extra]
    done = subprocess.run([sys.executable, "-m", "flows.post_train", *overrides], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    console = done.stdout + done.stderr
    assert "pid=" not in console  # Ray workers of the attached cluster write to the run folder, not the console
    run_dir = Path(re.search(r"^logs: (\S+)/run\.log", console, re.M).group(1))
    assert ":actor_name:ActorRolloutWorker" in (run_dir / "workers" / "rl.log").read_text()
    return console + (run_dir / "run.log").read_text()


def inspect(address: str) -> dict:
    done = subprocess.run([sys.executable, "-c", INSPECT, address], cwd=PROJECT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(PROJECT)}, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_up_records_the_address_and_is_idempotent(head):
    state_dir, state, stdout = head
    assert stdout.strip().splitlines()[-1] == f"ray.address={state.address}"
    assert state.address == f"127.0.0.1:{state.port}" and state.auth_mode == "token"
    again = cli(state_dir, "up", "--port", str(state.port))
    assert again.returncode == 0 and "already running" in again.stdout
    assert ClusterState.read(state_dir).pid == state.pid
    status = cli(state_dir, "status")
    assert status.returncode == 0 and "CPU 2/2 free" in status.stdout, status.stdout + status.stderr


def test_two_flow_runs_attach_to_the_cluster_and_leave_it_idle(head, tmp_path):
    state_dir, state, _ = head
    first = run_flow(tmp_path, state.address, "rl.total_steps=1")
    second = run_flow(tmp_path, state.address, "rl.total_steps=2")  # RL runs again; data prep is cached
    for output in (first, second):
        assert f"attached to Ray cluster at {state.address}" in output
        assert "started a local Ray cluster" not in output
    assert "data-prep cached" in second and "rl completed" in second
    assert first.count("attached to Ray cluster") >= 2  # RL and evaluation (EvalWorker, below)

    seen = inspect(state.address)
    flow_jobs = [j for j in seen["jobs"] if "flows.post_train" in j["entrypoint"]]
    assert len(flow_jobs) == first.count("attached to Ray") + second.count("attached to Ray")
    assert all(j["dead"] for j in flow_jobs)  # every stage disconnected
    assert {a["cls"] for a in seen["actors"]} >= {"ActorRolloutWorker", "EvalWorker"}
    assert all(a["state"] == "DEAD" for a in seen["actors"]), seen["actors"]
    assert seen["groups"] and all(g == "REMOVED" for g in seen["groups"])
    status = cli(state_dir, "status")
    assert "CPU 2/2 free" in status.stdout and ClusterState.read(state_dir).pid == state.pid


def test_down_stops_every_process_of_the_head_and_nothing_else(head):
    state_dir, state, _ = head
    assert len(session_members(state.pid)) >= 3  # ray start, gcs_server, raylet, ...
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        done = cli(state_dir, "down")
        assert done.returncode == 0 and f"stopped the Ray head at {state.address}" in done.stdout
        assert session_members(state.pid) == [] and ClusterState.read(state_dir) is None
        assert bystander.poll() is None
    finally:
        bystander.kill()
    status = cli(state_dir, "status")
    assert status.returncode == 1 and "not running" in status.stdout
    assert "nothing to stop" in cli(state_dir, "down").stdout


def test_a_busy_port_is_refused_before_anything_starts(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        sock.listen()
        port = sock.getsockname()[1]
        done = cli(tmp_path, "up", "--port", str(port), timeout=60)
    assert done.returncode == 1 and f"--port {port} is in use" in done.stderr and "pick a free port" in done.stderr
    assert not (tmp_path / "cluster.json").exists()
