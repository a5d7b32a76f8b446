"""Flow runs never share a run id or a run folder, and a run whose process is gone is found (infra.orphans)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from infra.config import load_config
from infra.orphans import PROCESS_FILE, orphans, record_process
from infra.store import ArtifactStore


def test_flows_started_in_the_same_second_get_their_own_ids(tmp_path):
    from flows.post_train import start_run

    cfg = load_config(None, [f"run.output_dir={tmp_path / 'out'}", f"storage.root={tmp_path / 'store'}"])
    ids = {start_run(cfg).run_id for _ in range(20)}  # far more than one per second
    assert len(ids) == 20
    store = ArtifactStore(str(tmp_path / "store"))
    assert len(store.glob("runs/*/config.yaml")) == 20


def test_a_run_whose_process_is_gone_is_an_orphan(tmp_path):
    runs = tmp_path / "runs"
    live, dead, other = runs / "live", runs / "dead", runs / "other-host"
    container = runs / "container"  # same hostname (host networking), a PID namespace of its own
    for folder in (live, dead, other, container):
        folder.mkdir(parents=True)
    record_process(live, "00000000-0000-0000-0000-000000000001")  # this process: alive
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {"flow_run_id": "00000000-0000-0000-0000-000000000002", "host": socket.gethostname(),
              "pid": int(ended.stdout), "started": 0.0}
    (dead / PROCESS_FILE).write_text(json.dumps(record))
    (other / PROCESS_FILE).write_text(json.dumps({**record, "host": "elsewhere"}))  # cannot be checked from here
    (container / PROCESS_FILE).write_text(json.dumps({**record, "pid_space": "boot/4026532999"}))  # nor this one
    found = orphans(tmp_path)
    assert [(folder.name, r["flow_run_id"][-1]) for folder, r in found] == [("dead", "2")]
    assert os.getpid() == json.loads((live / PROCESS_FILE).read_text())["pid"]
