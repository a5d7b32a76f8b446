"""One trainer per stage run: a lease in the store, so concurrent flows never write one run's rows twice.

A stage run is named by its cache key (`sft-<key>`, `rl-<key>`): two flows started with the same config
train the same run, in the same checkpoints and trajectory partitions. The first takes the lease
`leases/<name>.json` (created only if absent: `ArtifactStore.create_exclusive`) and renews it every
`HEARTBEAT_S` seconds from a thread; the second waits, saying so once, and takes it when the first is done
(then its stage resumes from the first's final checkpoint: no work is repeated) or when the holder's
heartbeat is older than `TTL_S` (on S3 with long storage timeouts more, as the record says: a renewal that
stalls up to the timeouts' bound still lands before anyone takes over) or its process is gone on this host (a
killed flow: its lease is stale). The age of a record from another host is never read from its time, which that
host's clock wrote (a clock minutes behind made a live lease look stale): it is how long this waiter has seen the
same record unchanged, on its own clock.

Taking over a stale lease deletes it and creates a new one. Two waiters that read the same stale record must not
both do that (the second would delete the first's fresh lease): a taker first creates the marker
`leases/<name>.json.taken-<hash of the record>` exclusively, and deletes the lease only if it still holds the
record it read. A marker outlives its taker's few milliseconds only if the taker was killed in between; one
older than `TTL_S` (by its own time when this host wrote it, else since a waiter first read it) is removed, and
the waiters sleep `POLL_S` meanwhile. A holder whose heartbeat stalled past `TTL_S` (a store outage, a paused VM)
and whose lease was taken over finds another owner at its next renewal: it writes nothing more to the lease, and
`check(name)`, which the stage's checkpoints and tables call before they write, raises `LeaseLost`, so two flows
never train one run. `check` does not wait for that renewal: when none has found the lease ours for half its life,
it reads the lease itself before the write goes on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

from infra.orphans import pid_is_checkable, pid_space
from infra.s3 import stall_bound_s
from infra.store import ArtifactStore, StoreError

logger = logging.getLogger(__name__)

TTL_S = 120.0  # a holder that has not renewed for this long is gone
HEARTBEAT_S = 20.0
POLL_S = 5.0


_LOST: set[str] = set()  # names of leases this process held and another flow run took over


@dataclass
class _Held:
    """A lease this process holds: where, as whom, and when a read last found it ours (time.monotonic())."""

    store: ArtifactStore
    path: str
    owner: str
    confirmed: float
    lock: threading.Lock = field(default_factory=threading.Lock)  # the heartbeat thread and `check` confirm it


_HELD: dict[str, _Held] = {}


class LeaseLost(RuntimeError):
    """Another flow run took over this stage run's lease: this one must stop writing."""


def check(name: str) -> None:
    """Raise `LeaseLost` when this process held the lease `name` and another flow run has taken it over. When no
    renewal has found the lease ours for half its life (the heartbeat stalled: a store outage, a paused process),
    the lease is read first, here: a waiter may have taken it over while the heartbeat thread has not looked yet."""
    held = _HELD.get(name)
    if name not in _LOST and held and time.monotonic() - held.confirmed > holder_ttl_s(held.store) / 2:
        _confirm(name, held)
    if name in _LOST:
        raise LeaseLost(f"leases/{name}.json was taken over by another flow run after this one's heartbeat "
                        f"stalled for over {TTL_S:.0f} s; that run trains {name} now, so this one stops here "
                        "without writing (its steps are redone there from the last checkpoint)")


def _confirm(name: str, held: _Held) -> bool:
    """Read the lease: ours -> renew it and note the time; another owner's -> `name` is lost. -> whether ours."""
    with held.lock:
        if name in _LOST:
            return False
        now = time.monotonic()
        holder = (_read(held.store, held.path) or {}).get("owner")
        if holder != held.owner:
            _LOST.add(name)
            logger.error("%s: the lease is now held by %s (this run's heartbeat stalled for over %.0f s); this run "
                         "stops writing %s", held.path, holder or "nobody", TTL_S, name)
            return False
        held.store.write_bytes(held.path, _record(held.owner, held.store))
        held.confirmed = now
        return True


@contextmanager
def stage_lease(store: ArtifactStore, name: str, owner: str) -> Iterator[None]:
    """Hold leases/<name>.json while the block runs; waits for a live holder to finish first."""
    path = f"leases/{name}.json"
    _acquire(store, path, owner)
    _LOST.discard(name)
    held = _HELD[name] = _Held(store, path, owner, time.monotonic())
    stop = threading.Event()
    beat = threading.Thread(target=_renew, args=(name, held, stop), daemon=True, name=f"lease-{name}")
    beat.start()
    failed = True
    try:
        yield
        failed = False
    finally:
        stop.set()
        beat.join()
        try:
            if name not in _LOST and (_read(store, path) or {}).get("owner") == owner:
                store.delete_table_file(path)
        except StoreError as exc:
            if not failed:
                raise
            # the stage's own error (often the same storage fault) is the one to report
            logger.warning("%s: could not release the lease (%s); it goes stale in %.0f s", path, exc, TTL_S)
        _LOST.discard(name)
        _HELD.pop(name, None)


def _record(owner: str, store: ArtifactStore | None = None) -> bytes:
    me = psutil.Process()
    return json.dumps({"owner": owner, "host": socket.gethostname(), "pid_space": pid_space(), "pid": me.pid,
                       "started": me.create_time(), "renewed": time.time(), "ttl_s": holder_ttl_s(store)}).encode()


def holder_ttl_s(store: ArtifactStore | None) -> float:
    """How long this holder's lease lives without a renewal (its record says so to waiters): TTL_S, or on S3 more
    than the longest a renewal may take to land (a heartbeat, then a read and a write that may each stall up to
    the storage limits' bound), so that a late renewal never lands on the lease a waiter took over meanwhile."""
    if store is None or not store.is_remote:
        return TTL_S
    return max(TTL_S, HEARTBEAT_S + 2 * stall_bound_s(store.limits) + POLL_S)


def record_ttl_s(record: dict) -> float:
    """The lease's life without a renewal as its holder wrote it, never below TTL_S."""
    ttl = record.get("ttl_s")
    return max(TTL_S, float(ttl)) if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) else TTL_S


def _marker_record() -> bytes:
    return json.dumps({"host": socket.gethostname(), "renewed": time.time()}).encode()


def _read_raw(store: ArtifactStore, path: str) -> bytes | None:
    try:
        return store.read_bytes(path)
    except FileNotFoundError:
        return None


def _parse(raw: bytes) -> dict:
    """The record; an unreadable one (a torn write) has no host, so it ages from when a waiter first saw it."""
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    return record if isinstance(record, dict) else {"owner": "unknown (unreadable lease)"}


def _read(store: ArtifactStore, path: str) -> dict | None:
    raw = _read_raw(store, path)
    return None if raw is None else _parse(raw)


def age_s(record: dict, first_seen: float) -> float:
    """Seconds since `record` was written: by its own time when this host wrote it (one clock), else since this
    process first saw it unchanged (`first_seen`, time.monotonic()), so another host's clock never counts."""
    renewed = record.get("renewed")
    if record.get("host") == socket.gethostname() and isinstance(renewed, (int, float)):
        return time.time() - renewed
    return time.monotonic() - first_seen


def is_stale(record: dict, first_seen: float) -> bool:
    """Whether the lease `record` (first seen unchanged at `first_seen`, time.monotonic()) has lost its holder."""
    if age_s(record, first_seen) > record_ttl_s(record):
        return True
    if not pid_is_checkable(record) or "pid" not in record:  # another host, or a container's own PID namespace
        return False
    try:
        return abs(psutil.Process(record["pid"]).create_time() - record.get("started", 0)) > 1.0
    except psutil.NoSuchProcess:
        return True


def _acquire(store: ArtifactStore, path: str, owner: str) -> None:
    said, seen = False, {}  # seen: raw record -> when this process first read it (time.monotonic())
    while not store.create_exclusive(path, _record(owner, store)):
        raw = _read_raw(store, path)
        if raw is None:
            continue  # released between our two calls
        record = _parse(raw)
        if record.get("owner") == owner or is_stale(record, seen.setdefault(raw, time.monotonic())):
            if _take_over(store, path, raw, seen):
                logger.warning("%s: took over the lease of %s (its holder is gone)", path, record.get("owner"))
            else:
                time.sleep(POLL_S)  # another waiter is taking it over: the next create_exclusive decides
            continue
        if not said:
            logger.warning("%s is held by flow run %s (pid %s on %s): the same stage run is being trained there; "
                           "waiting for it to finish, then this one goes on from its result (a lease that is not "
                           "renewed goes stale in %.0f s)", path, record.get("owner"), record.get("pid"),
                           record.get("host"), record_ttl_s(record))
            said = True
        time.sleep(POLL_S)
    if said:
        logger.warning("%s: lease taken, going on", path)


def _take_over(store: ArtifactStore, path: str, raw: bytes, seen: dict[bytes, float] | None = None) -> bool:
    """Delete the stale lease `raw` unless another waiter is taking it over or has done so already; -> whether this
    one deleted it. seen: marker contents -> when this process first read them (time.monotonic())."""
    marker = f"{path}.taken-{hashlib.sha256(raw).hexdigest()[:16]}"
    if not store.create_exclusive(marker, _marker_record()):
        _drop_abandoned(store, marker, {} if seen is None else seen)
        return False  # another waiter is taking over this record: the next create_exclusive decides
    try:
        if _read_raw(store, path) == raw:
            store.delete_table_file(path)
            return True
        return False
    finally:
        store.delete_table_file(marker)


def _drop_abandoned(store: ArtifactStore, marker: str, seen: dict[bytes, float]) -> None:
    """Remove a take-over marker older than TTL_S. Its taker removes it within milliseconds unless it was killed in
    between; left there, it would stop every later take-over of the same stale record, forever."""
    raw = _read_raw(store, marker)
    if raw is None:
        return
    if age_s(_parse(raw), seen.setdefault(raw, time.monotonic())) > TTL_S:
        logger.warning("%s: removing a take-over marker older than %.0f s (its taker is gone)", marker, TTL_S)
        if _read_raw(store, marker) == raw:
            store.delete_table_file(marker)


def _renew(name: str, held: _Held, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        try:
            if not _confirm(name, held):
                return
        except (OSError, StoreError) as exc:  # the stage meets the store's error itself; keep renewing meanwhile
            logger.warning("%s: could not renew the lease (%s)", held.path, exc)
