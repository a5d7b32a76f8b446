"""Stage leases (infra.lease) on a real store: one holder at a time, a waiter goes on when the holder is done,
a dead or silent holder's lease is taken over; `create_exclusive` is atomic on a local folder and on S3."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time

import pytest

from infra import lease
from infra.store import ArtifactStore, StoreError


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(lease, "POLL_S", 0.02)
    monkeypatch.setattr(lease, "HEARTBEAT_S", 0.05)


@pytest.mark.parametrize("store", ["local", pytest.param("s3", marks=pytest.mark.s3)], indirect=True)
def test_create_exclusive_writes_once(store):
    assert store.create_exclusive("leases/x.json", b"first")
    assert not store.create_exclusive("leases/x.json", b"second")
    assert store.read_bytes("leases/x.json") == b"first"
    store.delete_table_file("leases/x.json")
    assert store.create_exclusive("leases/x.json", b"third")


def test_a_second_holder_waits_for_the_first(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    order = []

    def second():
        with lease.stage_lease(store, "rl-k", "flow-2"):
            order.append("second in")

    with lease.stage_lease(store, "rl-k", "flow-1"):
        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(0.3)  # the waiter polls meanwhile and must not get in
        assert json.loads(store.read_bytes("leases/rl-k.json"))["owner"] == "flow-1"
        order.append("first out")
    waiter.join(timeout=10)
    assert order == ["first out", "second in"]
    assert store.glob("leases/*") == []  # released


def test_the_lease_of_a_dead_process_is_taken_over(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = json.loads(lease._record("killed-flow"))
    record.update(pid=int(gone.stdout), started=0.0)  # a pid whose process has ended
    store.write_bytes("leases/sft-k.json", json.dumps(record).encode())
    with lease.stage_lease(store, "sft-k", "flow-3"):
        assert json.loads(store.read_bytes("leases/sft-k.json"))["owner"] == "flow-3"


def test_a_silent_holder_is_stale_after_the_ttl():
    mine = json.loads(lease._record("here"))
    assert not lease.is_stale(mine, time.monotonic())
    mine["renewed"] -= lease.TTL_S + 1  # this host's clock wrote it: its own time counts
    assert lease.is_stale(mine, time.monotonic())
    # Another host's time is never compared with ours: its clock may be minutes off. Its record is stale once seen
    # unchanged for TTL_S here.
    other = {"owner": "elsewhere", "host": "another-host", "pid": 1, "renewed": time.time() - 10 * lease.TTL_S}
    assert not lease.is_stale(other, time.monotonic())
    assert lease.is_stale(other, time.monotonic() - lease.TTL_S - 1)


def test_a_holder_in_another_pid_namespace_of_this_host_is_not_judged_by_its_pid():
    """Containers sharing the hostname (host networking) number processes on their own: a live holder's pid 1 is no
    process here, and its lease was taken over at once. Its record goes stale by age alone, as another host's."""
    record = json.loads(lease._record("in-a-container"))
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record.update(pid=int(dead_pid.stdout), started=0.0)
    assert lease.is_stale(record, time.monotonic())  # this PID space: the pid is checked, and it is gone
    record["pid_space"] = "another-boot/4026532999"
    assert not lease.is_stale(record, time.monotonic())
    record["renewed"] -= lease.TTL_S + 1  # this host's clock (one kernel): its age counts
    assert lease.is_stale(record, time.monotonic())


def test_a_live_holder_on_a_host_whose_clock_is_behind_keeps_its_lease(tmp_path, monkeypatch):
    """A holder on another host whose clock is 10 minutes behind ours: its renewals' times all look older than TTL_S
    here, and a waiter took the live lease over at once. Now the waiter waits while the record keeps changing, and
    takes over only once it stops changing for TTL_S."""
    monkeypatch.setattr(lease, "TTL_S", 0.5)
    store = ArtifactStore(str(tmp_path / "store"))
    path, stop, last_write = "leases/rl-skew.json", threading.Event(), [0.0]

    def renew():
        while not stop.wait(0.05):
            store.write_bytes(path, json.dumps({"owner": "far-flow", "host": "another-host", "pid": 1,
                                                "renewed": time.time() - 600}).encode())
            last_write[0] = time.monotonic()

    store.write_bytes(path, json.dumps({"owner": "far-flow", "host": "another-host", "pid": 1, "renewed": 0}).encode())
    holder = threading.Thread(target=renew)
    holder.start()
    threading.Timer(1.5, stop.set).start()  # the far holder lives 3 TTLs, then dies
    with lease.stage_lease(store, "rl-skew", "flow-near"):
        entered = time.monotonic()
    holder.join()
    # taken only after the holder stopped, and its last record had stood unchanged for TTL_S (the old code: at once)
    assert stop.is_set() and entered - last_write[0] >= lease.TTL_S


def test_the_holder_renews_its_lease(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    with lease.stage_lease(store, "rl-r", "flow-4"):
        first = json.loads(store.read_bytes("leases/rl-r.json"))["renewed"]
        time.sleep(0.3)
        assert json.loads(store.read_bytes("leases/rl-r.json"))["renewed"] > first


def test_a_failing_release_does_not_hide_the_stages_error(tmp_path, monkeypatch, caplog):
    """A storage fault often hits the stage and then the release: the stage's error is the one raised."""
    store = ArtifactStore(str(tmp_path / "store"))

    def unreachable(relpath):
        raise StoreError(f"reading {relpath} failed")

    with pytest.raises(ValueError, match="the stage's error"):
        with lease.stage_lease(store, "rl-f", "flow-5"):
            monkeypatch.setattr(store, "read_bytes", unreachable)
            raise ValueError("the stage's error")
    assert "could not release the lease" in caplog.text
    store = ArtifactStore(str(tmp_path / "store"))
    with pytest.raises(StoreError, match="reading leases/rl-g.json"):  # without a stage error, it is the error
        with lease.stage_lease(store, "rl-g", "flow-6"):
            monkeypatch.setattr(store, "read_bytes", unreachable)


def _stale(owner: str) -> bytes:
    record = json.loads(lease._record(owner))
    record["renewed"] -= lease.TTL_S + 1
    return json.dumps(record).encode()


def test_a_stale_lease_is_taken_over_once_when_two_waiters_read_it(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    path, stale = "leases/rl-t.json", _stale("gone")
    store.write_bytes(path, stale)
    lease._take_over(store, path, stale)  # waiter A deletes the stale record and creates its own
    assert store.create_exclusive(path, b'{"owner": "A"}')
    lease._take_over(store, path, stale)  # waiter B read the same stale record before: it must not delete A's
    assert store.read_bytes(path) == b'{"owner": "A"}'
    store.write_bytes(path, stale)
    assert store.create_exclusive(f"{path}.taken-{hashlib.sha256(stale).hexdigest()[:16]}", b"{}")
    lease._take_over(store, path, stale)  # A is taking it over right now: B leaves it to A
    assert store.read_bytes(path) == stale


def test_racing_waiters_never_hold_a_stale_lease_together(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    for trial in range(40):
        name = f"rl-race{trial}"
        store.write_bytes(f"leases/{name}.json", _stale("gone"))
        inside, both, start = [], [], threading.Barrier(2)

        def waiter(owner, name=name, inside=inside, both=both, start=start):
            start.wait()
            with lease.stage_lease(store, name, owner):
                inside.append(owner)
                both.append(len(inside))
                time.sleep(0.01)
                inside.remove(owner)

        threads = [threading.Thread(target=waiter, args=(o,)) for o in ("A", "B")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert sorted(both) == [1, 1], trial  # each got in, one after the other


def test_a_holder_whose_lease_was_taken_over_stops_writing(tmp_path, caplog):
    store = ArtifactStore(str(tmp_path / "store"))
    with lease.stage_lease(store, "rl-o", "flow-7"):
        lease.check("rl-o")  # held: nothing to say
        store.write_bytes("leases/rl-o.json", json.dumps({"owner": "flow-8", "renewed": time.time()}).encode())
        time.sleep(0.3)  # a few heartbeats
        assert json.loads(store.read_bytes("leases/rl-o.json"))["owner"] == "flow-8"  # not overwritten
        with pytest.raises(lease.LeaseLost, match=r"leases/rl-o.json was taken over by another flow run"):
            lease.check("rl-o")
    assert json.loads(store.read_bytes("leases/rl-o.json"))["owner"] == "flow-8"  # not released either
    assert "the lease is now held by flow-8" in caplog.text
    lease.check("rl-o")  # the block is over: the name is free for a later stage_lease


def test_an_unreadable_lease_goes_stale(tmp_path, monkeypatch):
    """A torn or empty lease file (a power loss mid-write) must not block every waiter forever."""
    monkeypatch.setattr(lease, "TTL_S", 0.2)
    store = ArtifactStore(str(tmp_path / "store"))
    store.write_bytes("leases/sft-u.json", b"")
    with lease.stage_lease(store, "sft-u", "flow-9"):
        assert json.loads(store.read_bytes("leases/sft-u.json"))["owner"] == "flow-9"
    assert store.glob("leases/*") == []


def test_a_marker_left_by_a_killed_taker_does_not_block_or_spin_the_waiters(tmp_path, monkeypatch):
    """A taker killed between creating its marker and removing it (milliseconds) leaves the marker behind: the
    waiters must sleep meanwhile (not call the store in a tight loop), and take over once the marker is older than
    TTL_S, counted from when they first read it when it carries no time (here: b"{}")."""
    monkeypatch.setattr(lease, "TTL_S", 0.5)
    store = ArtifactStore(str(tmp_path / "store"))
    path, stale = "leases/rl-m.json", _stale("gone")
    store.write_bytes(path, stale)
    marker = f"{path}.taken-{hashlib.sha256(stale).hexdigest()[:16]}"
    assert store.create_exclusive(marker, b"{}")
    calls, create = [], store.create_exclusive

    def counted(relpath, data):
        calls.append(relpath)
        if len(calls) > 1000:
            raise RuntimeError("the waiter calls the store in a tight loop")
        return create(relpath, data)

    monkeypatch.setattr(store, "create_exclusive", counted)
    start = time.monotonic()
    with lease.stage_lease(store, "rl-m", "flow-10"):
        waited_s = time.monotonic() - start
        assert json.loads(store.read_bytes(path))["owner"] == "flow-10"
    assert lease.TTL_S <= waited_s < 5
    # one round of create_exclusive (lease, marker) per POLL_S = 0.02 s, plus the take-over: 2 * 0.5 / 0.02 + 3
    assert len(calls) <= 2 * waited_s / lease.POLL_S + 3, len(calls)
    assert store.glob("leases/*") == []  # the old marker and the lease are gone


def test_a_marker_with_a_recent_time_is_respected(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    path, stale = "leases/rl-n.json", _stale("gone")
    store.write_bytes(path, stale)
    marker = f"{path}.taken-{hashlib.sha256(stale).hexdigest()[:16]}"
    assert store.create_exclusive(marker, lease._marker_record())
    assert not lease._take_over(store, path, stale, {})  # a taker is at work: leave the lease to it
    assert store.read_bytes(path) == stale and store.read_bytes(marker)
    old = {**json.loads(lease._marker_record()), "renewed": time.time() - lease.TTL_S - 1}
    store.write_bytes(marker, json.dumps(old).encode())
    assert not lease._take_over(store, path, stale, {})  # its taker died: the marker goes, the next round takes over
    assert store.glob("leases/*") == [path]
    assert lease._take_over(store, path, stale, {}) and store.glob("leases/*") == []


def test_a_holder_on_slow_s3_limits_advertises_a_longer_life_that_waiters_honour(tmp_path):
    """With storage.timeout_s=40 one renewal may stall ~3 minutes before it lands: past TTL_S, a waiter took the
    lease over and the late renewal overwrote the new holder's lease (which then stopped, the old one went on)."""
    from infra.config_sections import StorageConfig

    slow = ArtifactStore("s3://bucket/p", "http://127.0.0.1:9", tmp_path / "c",
                         limits=StorageConfig(timeout_s=40, max_attempts=3))
    record = json.loads(lease._record("slow-holder", slow))
    assert record["ttl_s"] == lease.HEARTBEAT_S + 2 * (3 * 40 + 1 + 2) + lease.POLL_S > lease.TTL_S
    record["renewed"] -= lease.TTL_S + 1  # older than TTL_S, younger than its own life
    assert not lease.is_stale(record, time.monotonic())
    record["renewed"] -= record["ttl_s"]
    assert lease.is_stale(record, time.monotonic())
    local = json.loads(lease._record("here", ArtifactStore(str(tmp_path / "store"))))
    assert local["ttl_s"] == lease.TTL_S
    assert lease.record_ttl_s({**local, "ttl_s": 1.0}) == lease.TTL_S  # a record never shortens the life


def test_a_lease_lost_during_a_checkpoint_upload_prunes_nothing(tmp_path, monkeypatch):
    from infra.checkpoints import StoreCheckpoints

    store = ArtifactStore(str(tmp_path / "store"))
    checkpoints = StoreCheckpoints(store, "rl-up", max_to_keep=1)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "trainer.pt").write_text("1")
    checkpoints.save(1, folder)
    put_dir = store.put_dir

    def upload_then_lose(*args, **kwargs):
        ref = put_dir(*args, **kwargs)
        lease._LOST.add("rl-up")  # taken over while the upload ran
        return ref

    monkeypatch.setattr(store, "put_dir", upload_then_lose)
    (folder / "trainer.pt").write_text("2")
    try:
        with pytest.raises(lease.LeaseLost):
            checkpoints.save(2, folder)
    finally:
        lease._LOST.discard("rl-up")
    assert sorted(m.metadata["step"] for m in store.versions("checkpoint", "rl-up")) == [1, 2]  # step 1 kept


def test_a_holder_whose_heartbeat_stalled_reads_its_lease_before_writing(tmp_path, monkeypatch, caplog):
    """A holder paused past the lease's life (a suspended VM) resumes writing at once, while its heartbeat thread
    looks only at its next beat: a waiter that took the lease over meanwhile trained the same run beside it. `check`
    reads the lease itself when no renewal has confirmed it for half its life."""
    monkeypatch.setattr(lease, "HEARTBEAT_S", 3600.0)  # the heartbeat thread never beats in this test
    monkeypatch.setattr(lease, "TTL_S", 0.2)
    store = ArtifactStore(str(tmp_path / "store"))
    with lease.stage_lease(store, "rl-p", "flow-1"):
        lease.check("rl-p")  # confirmed at acquire: no read
        time.sleep(0.15)  # past half the life without a renewal
        lease.check("rl-p")  # still ours: read, renewed, goes on
        assert json.loads(store.read_bytes("leases/rl-p.json"))["owner"] == "flow-1"
        store.write_bytes("leases/rl-p.json", json.dumps({"owner": "flow-2", "renewed": time.time()}).encode())
        time.sleep(0.15)
        with pytest.raises(lease.LeaseLost, match=r"leases/rl-p.json was taken over by another flow run"):
            lease.check("rl-p")
    assert json.loads(store.read_bytes("leases/rl-p.json"))["owner"] == "flow-2"  # neither renewed nor released
    assert "the lease is now held by flow-2" in caplog.text
