"""The deployment path for real, with the venv's `prefect` commands a user types: a Prefect server on
127.0.0.1, a process work pool, `prefect deploy --all` from prefect.yaml, a process worker started in another
folder, and `prefect deployment run 'post-train/demo'` with tiny overrides, run to COMPLETED; its artifacts
are in the store. Worker and server are stopped even when the test fails."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from infra.cluster import session_members
from infra.sql import query
from infra.store import ArtifactStore
from tests.conftest import TINY_OVERRIDES, free_port

pytestmark = pytest.mark.slow
PROJECT = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")
POOL = "rlpipe-process"
RL_STEPS = 2
TINY_RL = [f"rl.total_steps={RL_STEPS}", "rl.train_batch_size=8", "rl.rollout.n=2", "rl.actor.ppo_mini_batch_size=4",
           "rl.rollout.engine=hf", "rl.test_freq=0", "rl.val_before_train=false", "rl.save_freq=1",
           "rl.reward.num_workers=1", "evaluate.engine=hf", "evaluate.max_samples=8", "ray.num_cpus=2",
           "data.max_response_length=16", "tracking.backends=[jsonl]"]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}



def stop(process: subprocess.Popen, grace_s: float = 30) -> None:
    """Ctrl-C (Prefect's graceful shutdown), then SIGKILL whatever of its session is left (flow runs, Ray)."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    for pid in session_members(process.pid):
        os.kill(pid, signal.SIGKILL)
    process.wait(timeout=30)


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


class Prefect:
    """A Prefect server of this test on 127.0.0.1 and the environment every prefect command gets."""

    def __init__(self, home: Path):
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        # a user's shell, without what infra/prefect_env.py set in this test's process
        inherited = {k: v for k, v in os.environ.items() if k != "PREFECT_LOGGING_EXTRA_LOGGERS"}
        self.env = {**inherited, "PYTHONPATH": str(PROJECT), "PREFECT_HOME": str(home), "PREFECT_API_URL": self.api,
                    "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "results"),
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no telemetry
                    "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false"}  # the nightly run is never due here
        self.logs = home / "logs"
        self.logs.mkdir(parents=True)
        self.processes: list[subprocess.Popen] = []

    def start(self, name: str, *args: str, cwd: Path = PROJECT) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("w") as out:
            process = subprocess.Popen([PREFECT, *args], cwd=cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes.append(process)
        return process

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def run(self, *args: str, cwd: Path = PROJECT, timeout: float = 300) -> str:
        done = subprocess.run([PREFECT, *args], cwd=cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def wait_healthy(self, server: subprocess.Popen, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert server.poll() is None, "prefect server exited:\n" + self.log("server")
            try:
                if get_json(f"{self.api}/health") is True:
                    return
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError(f"prefect server not healthy after {timeout_s} s:\n" + self.log("server"))

    def flow_run_loggers(self, run_id: str) -> set[str]:
        """The names of the loggers whose records the flow run sent to the server."""
        names: set[str] = set()
        for offset in range(0, 100_000, 200):
            body = json.dumps({"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200, "offset": offset})
            request = urllib.request.Request(f"{self.api}/logs/filter", data=body.encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as response:
                page = json.load(response)
            names |= {record["name"] for record in page}
            if len(page) < 200:
                return names
        return names

    def wait_flow_run(self, run_id: str, worker: subprocess.Popen, timeout_s: float = 1200) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = get_json(f"{self.api}/flow_runs/{run_id}")
            if run["state_type"] in TERMINAL:
                return run
            assert worker.poll() is None, "the worker exited:\n" + self.log("worker")[-5000:]
            time.sleep(3)
        raise AssertionError(f"flow run {run_id} not finished after {timeout_s} s:\n" + self.log("worker")[-5000:])

    def stop_all(self) -> None:
        for process in reversed(self.processes):  # the worker before the server
            stop(process)


@pytest.fixture
def prefect(tmp_path):
    server = Prefect(tmp_path / "prefect-home")
    try:
        process = server.start("server", "server", "start", "--host", "127.0.0.1", "--port", str(server.port))
        server.wait_healthy(process)
        yield server
    finally:
        server.stop_all()


def test_deploy_all_then_run_the_demo_through_a_process_worker(prefect, tmp_path):
    prefect.run("work-pool", "create", POOL, "--type", "process")
    prefect.run("deploy", "--all", "--no-prompt")  # from the project folder, as a user does

    demo = json.loads(prefect.run("deployment", "inspect", "post-train/demo", "--output", "json"))
    nightly = json.loads(prefect.run("deployment", "inspect", "post-train/gsm8k-grpo", "--output", "json"))
    assert demo["work_pool_name"] == nightly["work_pool_name"] == POOL
    assert demo["parameters"] == {"recipe": "recipes/demo.yaml", "overrides": []}
    assert nightly["parameters"]["recipe"] == "recipes/gsm8k_grpo.yaml"
    [schedule] = nightly["schedules"]
    assert schedule["schedule"]["cron"] == "0 2 * * *" and schedule["schedule"]["timezone"] == "UTC"
    assert schedule["active"] and demo["schedules"] == []
    # the build step recorded this folder; each flow run starts there
    assert demo["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(PROJECT)}}]

    elsewhere = tmp_path / "elsewhere"  # the worker need not run from the project
    elsewhere.mkdir()
    worker = prefect.start("worker", "worker", "start", "--pool", POOL, cwd=elsewhere)
    store, out = tmp_path / "store", tmp_path / "out"
    overrides = [*TINY_OVERRIDES, *TINY_RL, f"storage.root={store}", f"run.output_dir={out}"]
    created = prefect.run("deployment", "run", "post-train/demo", "--param", f"overrides={json.dumps(overrides)}",
                          cwd=elsewhere)
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", created).group(1)

    run = prefect.wait_flow_run(run_id, worker)
    assert run["state_type"] == "COMPLETED", prefect.log("worker")[-8000:]
    assert run["parameters"]["recipe"] == "recipes/demo.yaml" and run["parameters"]["overrides"] == overrides

    artifacts = ArtifactStore(str(store))
    names = set(artifacts.artifacts())
    assert {("dataset", "synthetic"), ("model", "base-tiny-qwen2"), ("model", "sft"), ("model", "rl"),
            ("eval", "base"), ("eval", "sft"), ("eval", "rl")} <= names, names
    [rl_checkpoints] = [name for kind, name in names if kind == "checkpoint" and name.startswith("rl-")]
    assert max(m.metadata["step"] for m in artifacts.versions("checkpoint", rl_checkpoints)) == RL_STEPS
    steps = query(str(store), "SELECT step, count(*) AS n FROM rollouts GROUP BY 1 ORDER BY 1")
    assert steps == [{"step": s, "n": 8 * 2} for s in range(1, RL_STEPS + 1)]
    [run_dir] = (out / "runs").iterdir()  # the run's resolved config: the demo recipe plus our overrides
    assert "name: demo" in (run_dir / "config.yaml").read_text()
    console = prefect.log("worker")  # the flow run's console, through the worker: quiet, logs in the run folder
    assert re.search(r"^\S+ rl +ran ", console, re.M) and "pid=" not in console, console[-5000:]
    assert (run_dir / "run.log").stat().st_size and (run_dir / "workers" / "rl.log").stat().st_size
    # our loggers' lines reach the run's logs in Prefect (prefect.yaml's env: the flow-run process imports Prefect
    # before the flow's module could configure it)
    loggers = prefect.flow_run_loggers(run_id)
    assert any(name.startswith(("stages.", "infra.")) for name in loggers), loggers
