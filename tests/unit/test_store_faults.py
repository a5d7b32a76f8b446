"""An S3 store whose requests fail part way: a failed upload never removes a version that another writer committed
meanwhile, and a listing on a stalled endpoint fails with the store's own error (root, endpoint, fix), never a raw
botocore exception. Fast: the local S3 server of tests/conftest.py, and tests/faults.py's proxy with one short
attempt per request."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from botocore.exceptions import EndpointConnectionError

from infra.config_sections import StorageConfig
from infra.store import ArtifactStore, StoreError
from tests.faults import FaultProxy

pytestmark = pytest.mark.s3

FILES = {"a.parquet": b"a" * 1000, "b.parquet": b"b" * 1000, "c.parquet": b"c" * 1000}
TIMED_OUT = "Fix: the endpoint did not answer in 1 attempts of storage.timeout_s=0.5 s"


def make_dir(root: Path) -> Path:
    root.mkdir()
    for rel, data in FILES.items():
        (root / rel).write_bytes(data)
    return root


def fail_second_upload(store: ArtifactStore, monkeypatch, before_failing=lambda: None) -> None:
    """store's second file upload runs before_failing(), then fails as a dropped connection does."""
    calls, upload = [], store._write_file

    def write(src, dest):
        calls.append(dest)
        if len(calls) == 2:
            before_failing()
            raise EndpointConnectionError(endpoint_url=store.endpoint_url)
        upload(src, dest)

    monkeypatch.setattr(store, "_write_file", write)


@pytest.fixture
def two_writers(s3_server, tmp_path) -> tuple[ArtifactStore, ArtifactStore]:
    """Two stores on the same bucket and prefix, as two flows storing the same dataset."""
    root = f"s3://{s3_server.create_bucket()}/p"
    return (ArtifactStore(root, s3_server.endpoint_url, tmp_path / "cache-a"),
            ArtifactStore(root, s3_server.endpoint_url, tmp_path / "cache-b"))


def test_a_failed_upload_keeps_the_version_another_writer_committed(two_writers, tmp_path, monkeypatch, caplog):
    a, b = two_writers
    src = make_dir(tmp_path / "src")
    committed = []
    fail_second_upload(b, monkeypatch, before_failing=lambda: committed.append(a.put_dir("dataset", "d", src)))
    with caplog.at_level(logging.WARNING, logger="infra.store"):
        ref = b.put_dir("dataset", "d", src)  # the content is stored: success, as on a local store
    assert [ref] == committed and a.latest("dataset", "d") == ref
    assert a.verify(ref).files.keys() == FILES.keys()  # every file is still there, intact
    assert any(f"the upload of {ref} failed" in r.getMessage() and "keeping it" in r.getMessage()
               for r in caplog.records), caplog.text


def test_a_failed_upload_removes_nothing_when_the_store_cannot_say_whether_it_was_committed(
        two_writers, tmp_path, monkeypatch):
    _, b = two_writers
    fail_second_upload(b, monkeypatch)

    def unreachable(ref):
        raise StoreError("reading the manifest failed")

    monkeypatch.setattr(b, "exists", unreachable)
    monkeypatch.setattr(b.fs, "rm", lambda *a, **k: pytest.fail("removed files of a version that may be committed"))
    with pytest.raises(StoreError, match="upload of dataset/d@.* no version was committed"):
        b.put_dir("dataset", "d", make_dir(tmp_path / "src"))


def test_versions_on_a_stalled_endpoint_is_a_store_error(s3_server, tmp_path, monkeypatch):
    """versions() reads the manifests in one batch that returns errors as values: a timeout among them is the
    store's StoreError naming the listing, the root, the endpoint and the fix."""
    proxy = FaultProxy(s3_server.port)
    try:
        limits = StorageConfig(root=f"s3://{s3_server.create_bucket()}/p", endpoint_url=proxy.endpoint_url,
                               timeout_s=0.5, max_attempts=1)
        store = ArtifactStore(limits.root, limits.endpoint_url, tmp_path / "cache", limits=limits)
        ref = store.put_dir("model", "m", make_dir(tmp_path / "src"))
        list_dirs = store._ls_dirs

        def list_then_stall(path):  # the folders are listed, then the endpoint stops answering
            found = list_dirs(path)
            proxy.stall()
            return found

        monkeypatch.setattr(store, "_ls_dirs", list_then_stall)
        with pytest.raises(StoreError) as info:
            store.versions("model", "m")
        message = str(info.value)
        assert message.startswith(f"listing model/m at storage.root='{limits.root}' "), message
        assert f"storage.endpoint_url='{proxy.endpoint_url}'" in message and TIMED_OUT in message, message
        proxy.pass_through()
        monkeypatch.setattr(store, "_ls_dirs", list_dirs)
        assert [m.ref for m in store.versions("model", "m")] == [ref]  # works again once the endpoint answers
    finally:
        proxy.close()


def refuse_every_deleted_key(store: ArtifactStore, monkeypatch) -> None:
    """The S3 server answers DeleteObjects 200 with an error per key and deletes nothing (AWS does so per key: e.g.
    AccessDenied, InternalError); s3fs does not look at those errors."""
    call = store.fs._call_s3

    async def call_s3(method, *args, **kwargs):
        if method == "delete_objects":
            return {"Errors": [{"Key": o["Key"], "Code": "AccessDenied", "Message": "no"}
                               for o in kwargs["Delete"]["Objects"]]}
        return await call(method, *args, **kwargs)

    monkeypatch.setattr(store.fs, "_call_s3", call_s3)


def test_a_removal_the_server_refuses_per_key_is_a_store_error_not_a_silent_success(s3_server, tmp_path,
                                                                                    monkeypatch):
    """A resume's truncate_after reported its partitions removed while every one stayed (the abandoned attempt's
    rows stayed visible); delete and gc likewise."""
    from infra.trajectories import RunTables

    root = f"s3://{s3_server.create_bucket()}/p"
    store = ArtifactStore(root, s3_server.endpoint_url, tmp_path / "cache")
    tables = RunTables(store, "rl-x")
    for step in range(1, 5):
        tables.write_metrics(step, {"m": float(step)})
    ref = store.put_dir("model", "m", make_dir(tmp_path / "src"))
    refuse_every_deleted_key(store, monkeypatch)

    with pytest.raises(StoreError, match=rf"removing metrics/run_id=rl-x/step=00000003/part-0.parquet and 1 more "
                                         rf"table files at storage.root='{root}'.*: the storage refused to remove 2 "
                                         r"of 2 files \(\S+/step=00000003/part-0.parquet: AccessDenied no\)\. Fix: "):
        tables.truncate_after(2)
    with pytest.raises(StoreError, match=r"deleting model/m@\w+ at .*the storage refused to remove 1 of 1 files"):
        store.delete(ref)

    monkeypatch.undo()
    assert tables.truncate_after(2) == 2 and tables.steps("metrics") == [1, 2]


def test_files_removed_during_an_upload_leave_no_committed_version(s3_server, tmp_path, monkeypatch):
    """gc removing an abandoned upload of the same content (one prefix) just as this one started: the manifest was
    committed over the missing files, a corrupt version that every later read refused."""
    store = ArtifactStore(f"s3://{s3_server.create_bucket()}/p", s3_server.endpoint_url, tmp_path / "cache")
    upload, sent = store._write_file, []

    def write_then_lose_the_first(src, dest):
        upload(src, dest)
        sent.append(dest)
        if len(sent) == len(FILES):
            store.fs.rm_file(sent[0])  # what gc's removal of the shared prefix took

    monkeypatch.setattr(store, "_write_file", write_then_lose_the_first)
    with pytest.raises(StoreError, match=r"1 of its 3 files were gone or changed before its commit \(a\.parquet\): "
                                         r"another process removed them .*no version was committed\. Fix: rerun"):
        store.put_dir("dataset", "d", make_dir(tmp_path / "src"))
    assert store.versions("dataset", "d") == []
    monkeypatch.undo()
    ref = store.put_dir("dataset", "d", tmp_path / "src")  # the rerun
    assert store.verify(ref).files.keys() == FILES.keys()
