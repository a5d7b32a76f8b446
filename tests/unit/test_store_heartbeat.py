"""An upload's heartbeat (infra/store_heartbeat.py): rewritten while the block runs, stopped and removed when it ends
(kept after a timeout, for gc), never a file of the version for readers, verification, listings, checkpoint
pruning or gc, and a name put_dir refuses. Fast: the heartbeat on a local folder with an interval of milliseconds,
and the store on a local folder and the local S3 server. The slow-upload and killed-writer cases against a
concurrent gc are tests/integration/test_store_heartbeat.py."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import fsspec
import pytest
from botocore.exceptions import ReadTimeoutError

from infra import store as store_module
from infra.artifacts import ArtifactRef, hash_dir
from infra.checkpoints import StoreCheckpoints
from infra.store import GC_MIN_AGE_S, ArtifactStore
from infra.store_base import HEARTBEAT
from infra.store_heartbeat import MAX_INTERVAL_S, heartbeat, interval_s
from tests.unit.test_store_integrity import make_dir, save_steps, stored_path

FILES = {"a.bin": b"a" * 100, "sub/b.bin": b"b" * 10}


def beat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("store-heartbeat")]


def test_the_interval_is_a_sixth_of_the_gc_age_and_at_most_ten_minutes():
    assert MAX_INTERVAL_S == 600
    assert interval_s(GC_MIN_AGE_S) == 600  # 3600 / 6
    assert interval_s(2 * 6111) == 600  # a slow storage's age (test_store_gc): 2037 s capped
    assert interval_s(60) == 10 and interval_s(0.06) == pytest.approx(0.01)


def test_the_heartbeat_is_rewritten_while_the_block_runs_and_removed_after(tmp_path):
    fs, path = fsspec.filesystem("file", auto_mkdir=True), tmp_path / HEARTBEAT
    beats = []
    with heartbeat(fs, str(tmp_path), min_age_s=0.06):  # a beat every 10 ms
        assert path.is_file() and len(beat_threads()) == 1  # written before the block starts
        deadline = time.monotonic() + 5
        while len(beats) < 4 and time.monotonic() < deadline:
            content = path.read_text()
            if not beats or content != beats[-1]:
                beats.append(content)  # each beat names its time: a new content is a new beat
            time.sleep(0.002)
    assert len(beats) == 4 and beats[0].startswith("upload in progress: ")
    assert not path.exists() and beat_threads() == []


def test_a_timed_out_write_leaves_its_heartbeat_for_gc_and_other_failures_remove_it(tmp_path):
    fs = fsspec.filesystem("file", auto_mkdir=True)
    with pytest.raises(ReadTimeoutError):  # the storage does not answer: no further request, gc removes it later
        with heartbeat(fs, str(tmp_path / "timed-out"), min_age_s=GC_MIN_AGE_S):
            raise ReadTimeoutError(endpoint_url="http://127.0.0.1:1")
    with pytest.raises(ConnectionResetError):
        with heartbeat(fs, str(tmp_path / "reset"), min_age_s=GC_MIN_AGE_S):
            raise ConnectionResetError("connection reset by peer")
    assert (tmp_path / "timed-out" / HEARTBEAT).is_file() and not (tmp_path / "reset" / HEARTBEAT).exists()
    assert beat_threads() == []


def test_a_failed_beat_is_logged_and_the_next_one_retried(tmp_path, caplog):
    fs, failed = fsspec.filesystem("file", auto_mkdir=True), []
    pipe_file = fs.pipe_file

    def fail_the_second_beat(path, data, **kwargs):
        failed.append(path)
        if len(failed) == 2:
            raise ConnectionResetError("connection reset by peer")
        return pipe_file(path, data, **kwargs)

    fs.pipe_file = fail_the_second_beat  # this instance only (fsspec's sync mirror is an instance attribute)
    with caplog.at_level(logging.WARNING, logger="infra.store"):
        with heartbeat(fs, str(tmp_path), min_age_s=0.06):
            deadline = time.monotonic() + 5
            while len(failed) < 4 and time.monotonic() < deadline:
                time.sleep(0.002)
    assert len(failed) >= 4  # it went on beating after the failure
    assert f"could not rewrite the heartbeat {tmp_path}/{HEARTBEAT} (connection reset by peer)" in caplog.text


def test_an_upload_beats_until_its_manifest_is_written_and_leaves_no_heartbeat(store, tmp_path, monkeypatch):
    src = make_dir(tmp_path / "src", FILES)
    vdir = store._vdir(ArtifactRef("model", "m", hash_dir(src)[0]))
    seen, write_file = [], ArtifactStore._write_file

    def write_and_look(self, src_file, dest):  # what gc would see in the folder while each file is sent
        seen.append(self.fs.exists(f"{vdir}/{HEARTBEAT}"))
        write_file(self, src_file, dest)

    monkeypatch.setattr(ArtifactStore, "_write_file", write_and_look)
    ref = store.put_dir("model", "m", src)
    assert seen == ([True, True] if store.is_remote else [False, False])  # local: the copy moves the mtime
    assert not store.fs.exists(stored_path(store, ref, HEARTBEAT)) and beat_threads() == []
    assert store.sweep().num_fresh_leftovers == 0


def test_a_heartbeat_in_a_committed_version_is_no_file_of_it(store, tmp_path):
    """What a writer of the same content leaves in the folder (still running, or killed after another writer
    committed): verify, downloads, listings, gc and checkpoint pruning all treat the version as intact."""
    ckpts = StoreCheckpoints(store, "rl-h", max_to_keep=1)
    ref = save_steps(ckpts, tmp_path, [1])[1]
    store.fs.pipe_file(stored_path(store, ref, HEARTBEAT), b"upload in progress: another writer")
    assert store.verify(ref).files.keys() == {"w", "meta.json"}
    copy = store.get_dir(ref, dest=tmp_path / "copy")
    assert sorted(p.name for p in copy.iterdir()) == ["_manifest.json", "meta.json", "w"]
    assert ckpts.latest() is not None and [m.ref for m in store.versions("checkpoint", "rl-h")] == [ref]
    assert store.artifacts() == [("checkpoint", "rl-h")] and store.manifest_refs() == [ref]
    report = store.sweep(remove_corrupt=True)
    assert (report.leftovers, report.num_fresh_leftovers, report.corrupt) == ([], 0, [])
    save_steps(ckpts, tmp_path / "later", [2])  # pruning removes step 1, heartbeat and all
    assert not store.fs.exists(store._vdir(ref))


def test_put_dir_refuses_a_file_named_like_the_heartbeat(store, tmp_path):
    with pytest.raises(ValueError, match=f"contains {HEARTBEAT}, a name the store reserves for the heartbeat"):
        store.put_dir("dataset", "d", make_dir(tmp_path / "src", {HEARTBEAT: b"mine", "a.bin": b"a"}))
    assert store.artifacts() == []
    ref = store.put_dir("dataset", "d", make_dir(tmp_path / "nested", {f"sub/{HEARTBEAT}": b"mine"}))
    assert (store.get_dir(ref, dest=tmp_path / "copy") / "sub" / HEARTBEAT).read_bytes() == b"mine"


def test_a_version_stored_with_such_a_file_before_the_name_was_reserved_stays_intact(store, tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "check_sources", lambda sources: None)  # the store before the heartbeat
    monkeypatch.setattr(store_module, "heartbeat", lambda *args: contextlib.nullcontext())
    ref = store.put_dir("dataset", "old", make_dir(tmp_path / "src", {HEARTBEAT: b"theirs", "a.bin": b"a"}))
    monkeypatch.undo()
    assert store.verify(ref).files.keys() == {HEARTBEAT, "a.bin"}
    assert (store.get_dir(ref, dest=tmp_path / "copy") / HEARTBEAT).read_bytes() == b"theirs"
