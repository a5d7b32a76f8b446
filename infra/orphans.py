"""Flow runs whose process was killed (kill -9, the OOM killer, a closed terminal) stay RUNNING in Prefect:
nothing is left to report their end, and a deployment with a concurrency limit of 1 would wait for them forever.

Each flow run records its process in its run folder (`process.json`: flow run id, host, pid and the process's
start time, which tells a reused pid apart, and its PID space: the machine's boot id and the process's PID
namespace, since containers that share a hostname (host networking) number their processes each on their own) and
removes the file when it ends, however it ends. The next flow run
started with the same `run.output_dir` finds the files of processes that are gone on this host and marks their
flow runs, and the task runs still RUNNING in them, Crashed. Runs of other hosts are left alone: their processes
cannot be checked from here.

Temporary folders: a flow's stages make their temporary folders (stage outputs before they are stored,
checkpoints before upload, the merged model) in the run folder's `tmp/` (`RunContext.tmp_dir`), which
`run_scratch` removes when the flow ends, however it ends but kill -9; after a kill the next flow run removes it
with the crashed run's record. (Not `tempfile.tempdir`: Ray and vLLM put sockets there, whose paths must stay
short.)
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import UUID

import psutil

logger = logging.getLogger(__name__)

PROCESS_FILE = "process.json"
SCRATCH = "tmp"


@functools.cache
def pid_space() -> str:
    """This boot of this machine and this process's PID namespace ('/' where /proc has neither): pids name the same
    process only within one."""
    parts = []
    for read in (lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                 lambda: str(os.stat("/proc/self/ns/pid").st_ino)):
        try:
            parts.append(read())
        except OSError:
            parts.append("")
    return "/".join(parts)


def pid_is_checkable(record: dict) -> bool:
    """Whether the pid of `record` (a lease or a flow run's process) names a process this one can look up: written
    on this host in this PID space (a record without one, from before it was recorded: by host alone)."""
    return record.get("host") == socket.gethostname() and record.get("pid_space", pid_space()) == pid_space()


@contextmanager
def run_scratch(run_dir: Path) -> Iterator[Path]:
    """run_dir/tmp for the block's temporary folders; removed afterwards."""
    path = run_dir / SCRATCH
    path.mkdir(exist_ok=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def record_process(run_dir: Path, flow_run_id: str) -> None:
    me = psutil.Process()
    record = {"flow_run_id": flow_run_id, "host": socket.gethostname(), "pid_space": pid_space(), "pid": me.pid,
              "started": me.create_time()}
    (run_dir / PROCESS_FILE).write_text(json.dumps(record))


def mark_ended(run_dir: Path) -> None:
    (run_dir / PROCESS_FILE).unlink(missing_ok=True)


def is_gone(record: dict) -> bool:
    """Whether the process of a record on this host no longer runs (its pid is free or another process's)."""
    try:
        return abs(psutil.Process(record["pid"]).create_time() - record["started"]) > 1.0
    except psutil.NoSuchProcess:
        return True


def orphans(output_dir: Path) -> list[tuple[Path, dict]]:
    """(run folder, record) of the flow runs under `output_dir`/runs whose process on this host is gone."""
    found = []
    for path in sorted((output_dir / "runs").glob(f"*/{PROCESS_FILE}")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written right now, or not ours
        if pid_is_checkable(record) and record.get("pid") != os.getpid() and is_gone(record):
            found.append((path.parent, record))
    return found


def crash_orphans(output_dir: Path) -> list[str]:
    """Mark the flow runs of gone processes (and their RUNNING task runs) Crashed and remove their temporary
    folders; -> their flow run ids."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Crashed

    running_type = TaskRunFilterStateType(any_=[StateType.RUNNING])  # name=None: prefect 3.7 declares it required
    running = TaskRunFilter(state=TaskRunFilterState(type=running_type, name=None))
    crashed = []
    with get_client(sync_client=True) as client:
        for run_dir, record in orphans(output_dir):
            flow_run_id = UUID(record["flow_run_id"])
            message = (f"its process (pid {record['pid']} on {record['host']}) ended without reporting its state; "
                       "found by a later flow run")
            try:
                state = client.read_flow_run(flow_run_id).state_type
            except ObjectNotFound:  # recorded by another Prefect server or database
                state = None
            if state in (StateType.RUNNING, StateType.PENDING):
                client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
                of_flow = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
                for task_run in client.read_task_runs(flow_run_filter=of_flow, task_run_filter=running):
                    client.set_task_run_state(task_run.id, Crashed(message=message), force=True)
                crashed.append(str(flow_run_id))
            shutil.rmtree(run_dir / SCRATCH, ignore_errors=True)
            mark_ended(run_dir)
    return crashed
