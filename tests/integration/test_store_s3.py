"""S3-only behaviour of ArtifactStore against a real local S3 server: fail fast when storage is unreachable,
and an outage in the middle of an upload commits nothing and a retry succeeds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from infra.config_sections import StorageConfig
from infra.store import ArtifactStore, CorruptArtifactError, StoreError
from tests.conftest import free_port

pytestmark = pytest.mark.s3

FILES = {"a.bin": b"a" * 1000, "sub/b.bin": b"b" * 1000, "sub/c.bin": b"c"}


def make_dir(root: Path) -> Path:
    for rel, data in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


@pytest.fixture
def s3_store(s3_server, tmp_path) -> ArtifactStore:
    bucket = s3_server.create_bucket()
    return ArtifactStore(f"s3://{bucket}/p", endpoint_url=s3_server.endpoint_url, cache_dir=tmp_path / "cache")


def test_unreachable_endpoint_fails_fast_with_one_clear_error(s3_server, tmp_path):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    store = ArtifactStore("s3://bucket/prefix", endpoint_url=endpoint, cache_dir=tmp_path / "cache")
    for call in (store.check, lambda: store.put_dir("dataset", "d", make_dir(tmp_path / "src"))):
        start = time.monotonic()
        with pytest.raises(StoreError) as info:
            call()
        assert time.monotonic() - start < 10
        message = str(info.value)
        assert "storage.root='s3://bucket/prefix'" in message and f"storage.endpoint_url='{endpoint}'" in message
        assert "Fix:" in message


def test_missing_bucket_is_named(s3_server):
    store = ArtifactStore("s3://no-such-bucket/p", endpoint_url=s3_server.endpoint_url)
    with pytest.raises(StoreError, match="bucket 'no-such-bucket' .*create it"):
        store.check()


def test_outage_mid_upload_commits_nothing_and_a_retry_succeeds(s3_server, s3_store, tmp_path, monkeypatch):
    s3_store.check()
    before = s3_store.put_dir("dataset", "kept", make_dir(tmp_path / "kept") / "sub")
    src, calls, original = make_dir(tmp_path / "src"), [], ArtifactStore._write_file

    def write_then_outage(self, src_file, dest):  # the server goes away after the first file
        if calls:
            s3_server.stop()
        calls.append(dest)
        return original(self, src_file, dest)

    monkeypatch.setattr(ArtifactStore, "_write_file", write_then_outage)
    start = time.monotonic()
    try:
        with pytest.raises(StoreError, match="upload of dataset/synthetic@.* failed.*no version was committed"):
            s3_store.put_dir("dataset", "synthetic", src)
        assert time.monotonic() - start < 10 and len(calls) == 2
    finally:
        if not s3_server.running:
            s3_server.start()
    monkeypatch.undo()
    assert s3_store.exists(before)  # moto kept its buckets and objects across stop/start
    assert s3_store.versions("dataset", "synthetic") == []
    ref = s3_store.put_dir("dataset", "synthetic", src)
    got = s3_store.get_dir(ref)
    assert {rel: (got / rel).read_bytes() for rel in FILES} == FILES
    assert s3_store.gc() == 0


def test_failed_upload_leftovers_are_invisible_until_retried(s3_server, s3_store, tmp_path, monkeypatch):
    """The files sent before the failure stay without a manifest, invisible; the retry commits."""
    src = make_dir(tmp_path / "src")
    calls, original = [], ArtifactStore._write_file

    def fail_second(self, src_file, dest):
        calls.append(dest)
        if len(calls) == 2:
            raise ConnectionResetError("connection reset by peer")
        return original(self, src_file, dest)

    monkeypatch.setattr(ArtifactStore, "_write_file", fail_second)
    with pytest.raises(StoreError, match="connection reset"):
        s3_store.put_dir("dataset", "synthetic", src)
    monkeypatch.undo()
    assert s3_store.fs.exists(calls[0]) and s3_store.artifacts() == []
    ref = s3_store.put_dir("dataset", "synthetic", src)  # overwrites the leftover and commits
    assert s3_store.fs.exists(calls[0]) and s3_store.latest("dataset", "synthetic") == ref
    assert s3_store.gc() == 0


def test_a_failed_upload_leaves_a_concurrent_writers_files_alone(s3_store, tmp_path, monkeypatch):
    """Two writers of the same content share the version's prefix. This one fails while the other has sent every
    file: removing the prefix (the old cleanup) deleted the other's files, which then committed a manifest over
    missing files, a corrupt version."""
    src, calls, original = make_dir(tmp_path / "src"), [], ArtifactStore._write_file
    version_dir = lambda dest: next(dest[: -len(rel) - 1] for rel in FILES if dest.endswith(f"/{rel}"))  # noqa: E731

    def other_writer_then_reset(self, src_file, dest):
        calls.append(dest)
        if len(calls) == 2:
            vdir = version_dir(dest)
            for rel, data in FILES.items():  # the other writer's files, sent meanwhile
                self.fs.pipe_file(f"{vdir}/{rel}", data)
            raise ConnectionResetError("connection reset by peer")
        return original(self, src_file, dest)

    monkeypatch.setattr(ArtifactStore, "_write_file", other_writer_then_reset)
    with pytest.raises(StoreError, match="connection reset.*no version was committed"):
        s3_store.put_dir("dataset", "synthetic", src)
    monkeypatch.undo()
    vdir = version_dir(calls[1])
    assert sorted(s3_store.fs.cat(f"{vdir}/{rel}") for rel in FILES) == sorted(FILES.values())
    assert s3_store.gc() == 0 and s3_store.artifacts() == []  # invisible; gc waits for the age


def test_endpoint_from_environment_and_config(s3_server, monkeypatch):
    bucket = s3_server.create_bucket()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    store = ArtifactStore.from_config(StorageConfig(root=f"s3://{bucket}/p"))
    assert store.endpoint_url == s3_server.endpoint_url and store.is_remote
    assert store.storage_options() == {"endpoint_url": s3_server.endpoint_url}
    store.check()
    store.write_bytes("t/x", b"x")
    assert store.read_bytes("t/x") == b"x" and store.url("t/x") == f"s3://{bucket}/p/t/x"


def test_corrupt_object_is_caught_on_download(s3_store, tmp_path):
    ref = s3_store.put_dir("model", "m", make_dir(tmp_path / "src"))
    s3_store.fs.pipe_file(f"{s3_store.url('artifacts')}/model/m/{ref.version}/a.bin", b"tampered")
    with pytest.raises(CorruptArtifactError, match="a.bin: 8 bytes, expected 1000"):
        s3_store.get_dir(ref)
    assert list((tmp_path / "cache" / "model" / "m").iterdir()) == []  # no partial copy left behind


def test_missing_credentials_name_the_environment_variables(s3_server, monkeypatch):
    store = ArtifactStore(f"s3://{s3_server.create_bucket()}/p", endpoint_url=s3_server.endpoint_url)
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup
    with pytest.raises(StoreError, match="Fix: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"):
        store.check()
