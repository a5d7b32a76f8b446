"""One trainer per stage run: a lease in the store, so concurrent flows never write one run's rows twice.

A stage run is named by its cache key (`sft-<key>`, `rl-<key>`): two flows started with the same config
train the same run, in the same checkpoints and trajectory partitions. The first takes the lease
`leases/<name>.json` (created only if absent: `ArtifactStore.create_exclusive`) and renews it every
`HEARTBEAT_S` seconds from a thread; the second waits, saying so once, and takes it when the first is done
(then its stage resumes from the first's final checkpoint: no work is repeated) or when the holder's
heartbeat is older than `TTL_S` or its process is gone on this host (a killed flow: its lease is stale).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from infra.store import ArtifactStore, StoreError

logger = logging.getLogger(__name__)

TTL_S = 120.0  # a holder that has not renewed for this long is gone
HEARTBEAT_S = 20.0
POLL_S = 5.0


@contextmanager
def stage_lease(store: ArtifactStore, name: str, owner: str) -> Iterator[None]:
    """Hold leases/<name>.json while the block runs; waits for a live holder to finish first."""
    path = f"leases/{name}.json"
    _acquire(store, path, owner)
    stop = threading.Event()
    beat = threading.Thread(target=_renew, args=(store, path, owner, stop), daemon=True, name=f"lease-{name}")
    beat.start()
    failed = True
    try:
        yield
        failed = False
    finally:
        stop.set()
        beat.join()
        try:
            if (_read(store, path) or {}).get("owner") == owner:
                store.delete_table_file(path)
        except StoreError as exc:
            if not failed:
                raise
            # the stage's own error (often the same storage fault) is the one to report
            logger.warning("%s: could not release the lease (%s); it goes stale in %.0f s", path, exc, TTL_S)


def _record(owner: str) -> bytes:
    me = psutil.Process()
    return json.dumps({"owner": owner, "host": socket.gethostname(), "pid": me.pid, "started": me.create_time(),
                       "renewed": time.time()}).encode()


def _read(store: ArtifactStore, path: str) -> dict | None:
    try:
        return json.loads(store.read_bytes(path))
    except FileNotFoundError:
        return None
    except ValueError:  # unreadable: treat as a holder of unknown age, stale after TTL_S from now
        return {"owner": "unknown", "renewed": time.time()}


def is_stale(record: dict) -> bool:
    if time.time() - record.get("renewed", 0) > TTL_S:
        return True
    if record.get("host") != socket.gethostname() or "pid" not in record:
        return False
    try:
        return abs(psutil.Process(record["pid"]).create_time() - record.get("started", 0)) > 1.0
    except psutil.NoSuchProcess:
        return True


def _acquire(store: ArtifactStore, path: str, owner: str) -> None:
    said = False
    while not store.create_exclusive(path, _record(owner)):
        record = _read(store, path)
        if record is None:
            continue  # released between our two calls
        if record.get("owner") == owner or is_stale(record):
            logger.warning("%s: taking over the lease of %s (its holder is gone)", path, record.get("owner"))
            store.delete_table_file(path)
            continue
        if not said:
            logger.warning("%s is held by flow run %s (pid %s on %s): the same stage run is being trained there; "
                           "waiting for it to finish, then this one goes on from its result", path,
                           record.get("owner"), record.get("pid"), record.get("host"))
            said = True
        time.sleep(POLL_S)
    if said:
        logger.warning("%s: lease taken, going on", path)


def _renew(store: ArtifactStore, path: str, owner: str, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        try:
            store.write_bytes(path, _record(owner))
        except (OSError, StoreError) as exc:  # the stage meets the store's error itself; keep renewing meanwhile
            logger.warning("%s: could not renew the lease (%s)", path, exc)
