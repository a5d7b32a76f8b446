"""Ctrl-C during a flow, as a user presses it in a terminal (SIGINT to the whole process group: the flow, Prefect's
temporary server, the local Ray cluster's processes): a short message with the command that resumes the run, exit
code 130, within seconds; and that command resumes RL from its last checkpoint. Before, Prefect's server died with
the flow, Prefect retried its report of the crash for minutes, and ~100 lines of tracebacks ended the run."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.test_flow import PROJECT, RL, _overrides

pytestmark = pytest.mark.slow


def test_ctrl_c_mid_rl_says_how_to_resume_and_that_command_resumes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(tmp_path / "prefect" / "results")}
    overrides = _overrides(tmp_path, *RL, "sft.enabled=false", "rl.total_steps=12", "rl.save_freq=2",
                           "evaluate.max_samples=4")
    console = tmp_path / "console.txt"
    with console.open("w") as out:
        flow = subprocess.Popen([sys.executable, "-m", "flows.post_train", *overrides], cwd=PROJECT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not list((tmp_path / "store").glob("artifacts/checkpoint/rl-*/*/_manifest.json")):
            assert flow.poll() is None and time.monotonic() < deadline, console.read_text()
            time.sleep(0.5)
        os.killpg(flow.pid, signal.SIGINT)  # what the terminal does with Ctrl-C
        interrupted = time.monotonic()
        flow.wait(timeout=120)
    finally:
        if flow.poll() is None:
            os.killpg(flow.pid, signal.SIGKILL)
    text = console.read_text()
    assert flow.returncode == 130, text
    assert time.monotonic() - interrupted < 60, text  # it took 1.5-4 minutes
    after = text.replace("\r", "\n").split(" rl            started\n", 1)[1]
    lines = [line for line in after.splitlines() if line.strip() and not line.startswith("rl: ")]
    assert len(lines) == 3, lines  # logs: ..., the message, the command
    assert lines[0].startswith("logs: ") and "Traceback" not in text and "Crash detected" not in text
    assert lines[1] == ("interrupted (Ctrl-C). Finished stages are cached and SFT and RL go on from their last "
                        "checkpoint; to resume, run the same command again:")
    command = shlex.split(lines[2])
    assert command == [sys.executable, "-m", "flows.post_train", *overrides]
    assert not _servers_of(tmp_path / "prefect")  # Prefect's server ended with the flow

    resumed = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert re.search(r"^\S+ data-prep +cached ", resumed.stdout, re.M), resumed.stdout
    run_logs = sorted((tmp_path / "out" / "runs").glob("*/run.log"), key=lambda p: p.stat().st_mtime)
    step = re.search(r"rl: resumed at step (\d+) from ", run_logs[-1].read_text())
    assert step and int(step.group(1)) >= 2, run_logs[-1].read_text()


def _servers_of(home) -> list[int]:
    """Pids of Prefect servers (uvicorn) that run with PREFECT_HOME=home."""
    found = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            environ = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        if b"uvicorn" in cmdline and f"PREFECT_HOME={home}\0".encode() in environ:
            found.append(pid)
    return found
