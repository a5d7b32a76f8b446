"""`python -m infra.cluster` when the recorded head's leader (`ray start --block`) is gone: processes of its session
that still run (gcs_server holding the port) are named by `status` and `up`, which send the user to `down`, the one
command that finds them; a pid taken over by an unrelated process is never the head's. No Ray is started: the head
is a session leader whose child holds the port, as in a head whose leader was SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from infra import cluster
from infra.cluster import ClusterError, ClusterState, session_members
from tests.conftest import free_port

HOLD_PORT = """
import socket, sys, time
sock = socket.socket()
sock.bind(("", int(sys.argv[1])))
sock.listen()
print("ready", flush=True)
time.sleep(120)
"""


def record(state_dir, pid: int, port: int) -> ClusterState:
    state = ClusterState(address=f"127.0.0.1:{port}", pid=pid, port=port, num_cpus=None, temp_dir="/tmp/none",
                         log=str(state_dir / "head.log"), auth_mode="token", started="2025-01-01T00:00:00+00:00")
    state.write(state_dir)
    return state


@pytest.fixture
def stale_head(tmp_path, monkeypatch):
    """A recorded head whose leader was SIGKILLed while its child, in the leader's session, holds the port."""
    monkeypatch.setattr(cluster, "_head_env", lambda: pytest.fail("up started a head"))
    port = free_port()
    leader = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; subprocess.Popen([sys.executable, "
                               f"'-c', {HOLD_PORT!r}, '{port}']); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert leader.stdout.readline() == "ready\n"  # the child holds the port
        state = record(tmp_path, leader.pid, port)
        leader.kill()
        leader.wait()  # reaped, as init reaps a real head's leader
        (child,) = session_members(leader.pid)
        yield tmp_path, state, child
    finally:
        leader.kill()
        for pid in session_members(leader.pid):  # only if `down` did not run or failed
            os.kill(pid, signal.SIGKILL)


def test_up_sends_the_user_to_down_and_keeps_the_record(stale_head, capsys):
    state_dir, state, child = stale_head
    with pytest.raises(ClusterError) as error:
        cluster.up(state.port, state_dir=state_dir)
    assert f"python -m infra.cluster --state-dir {state_dir} down" in str(error.value)
    assert f"pids {child};" in str(error.value)
    with pytest.raises(ClusterError, match="down"):  # the old advice, another --port, would orphan the child
        cluster.up(free_port(), state_dir=state_dir)
    assert ClusterState.read(state_dir) == state and session_members(state.pid) == [child]  # up stopped nothing

    assert cluster.main(["--state-dir", str(state_dir), "status"]) == 1
    assert f"`python -m infra.cluster --state-dir {state_dir} down`" in capsys.readouterr().out

    assert cluster.main(["--state-dir", str(state_dir), "down"]) == 0
    deadline = time.monotonic() + 10
    while session_members(state.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_members(state.pid) == [] and ClusterState.read(state_dir) is None
    assert cluster.main(["--state-dir", str(state_dir), "status"]) == 1
    assert "no state" in capsys.readouterr().out


def test_a_pid_taken_over_by_another_session_is_not_the_heads(tmp_path):
    """The head ended completely and its pid now leads an unrelated session: `down` forgets the head, stops nothing."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        record(tmp_path, other.pid, free_port())
        assert cluster.main(["--state-dir", str(tmp_path), "down"]) == 0
        assert ClusterState.read(tmp_path) is None
        time.sleep(0.2)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
