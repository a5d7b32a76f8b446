"""ArtifactStore on both backends (a tmp folder and a real local S3 server): roundtrips, idempotence, manifests,
ordering, deletion, mutable tables, crash safety and gc, plus the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
import pytest

from infra.artifacts import MANIFEST, ArtifactRef, code_version
from infra.config import ConfigError, load_config
from infra.store import ArtifactStore, StoreError

PROJECT = Path(__file__).resolve().parents[2]


def make_dir(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


NESTED = {"top.bin": bytes(range(256)) * 5, "a/b/c.txt": b"deep\n", "a/empty.txt": b"", "a/d.json": b"{}"}


class Crash(OSError):
    """A simulated failure in the middle of a write."""


def crash_after_first_file(monkeypatch, *, then=None) -> list[str]:
    """Make ArtifactStore._write_file fail on its second call (after `then()` if given); -> written dests."""
    written, original = [], ArtifactStore._write_file

    def write(self, src, dest):
        if written:
            if then is not None:
                then()
                return original(self, src, dest)
            raise Crash("simulated crash after the first file")
        written.append(dest)
        return original(self, src, dest)

    monkeypatch.setattr(ArtifactStore, "_write_file", write)
    return written


# ---------------------------------------------------------------------------------------------- refs


def test_ref_roundtrip_and_errors():
    ref = ArtifactRef.parse("dataset/synthetic@0123456789abcdef")
    assert (ref.kind, ref.name, ref.version) == ("dataset", "synthetic", "0123456789abcdef")
    assert str(ref) == "dataset/synthetic@0123456789abcdef"
    for bad in ["dataset/synthetic", "synthetic@0123456789abcdef", "a/b/c@0123456789abcdef"]:
        with pytest.raises(ValueError, match="kind/name@version"):
            ArtifactRef.parse(bad)
    with pytest.raises(ValueError, match="version='xyz'"):
        ArtifactRef("dataset", "synthetic", "xyz")
    with pytest.raises(ValueError, match="name='.staging'"):
        ArtifactRef("dataset", ".staging", "0123456789abcdef")


def test_version_is_the_documented_content_hash(tmp_path):
    """version = sha256 over sorted (path, NUL, 8-byte little-endian size, bytes), first 16 hex chars."""
    src = make_dir(tmp_path / "src", {"b.txt": b"yz", "a.txt": b"x"})
    expected = hashlib.sha256(b"a.txt\0" + (1).to_bytes(8, "little") + b"x"
                              + b"b.txt\0" + (2).to_bytes(8, "little") + b"yz").hexdigest()[:16]
    store = ArtifactStore(str(tmp_path / "store"))
    assert store.put_dir("dataset", "d", src).version == expected
    # Moving one byte from one file to the other keeps the concatenated bytes but changes the version.
    moved = make_dir(tmp_path / "moved", {"a.txt": b"xy", "b.txt": b"z"})
    assert store.put_dir("dataset", "d", moved).version != expected


# ---------------------------------------------------------------------------------------------- both backends


def test_put_get_roundtrip_nested(store, tmp_path):
    store.check()
    src = make_dir(tmp_path / "src", NESTED)
    ref = store.put_dir("dataset", "synthetic", src)
    got = store.get_dir(ref)
    assert {k: v for k, v in read_tree(got).items() if k != MANIFEST} == NESTED
    if store.is_remote:
        assert got == tmp_path / "cache" / "dataset" / "synthetic" / ref.version
    copy = store.get_dir(ref, dest=tmp_path / "copy")
    assert read_tree(copy) == read_tree(got)


def test_put_is_idempotent(store, tmp_path, monkeypatch):
    src = make_dir(tmp_path / "src", NESTED)
    ref = store.put_dir("dataset", "synthetic", src, metadata={"run": 1})
    first = store.manifest(ref)
    monkeypatch.setattr(ArtifactStore, "_write_file", lambda *a: pytest.fail("second put wrote a file"))
    assert store.put_dir("dataset", "synthetic", src, metadata={"run": 2}) == ref
    assert store.manifest(ref) == first  # created and metadata of the first put
    assert [m.ref for m in store.versions("dataset", "synthetic")] == [ref]


def test_manifest_fields(store, tmp_path):
    src = make_dir(tmp_path / "src", NESTED)
    upstream = store.put_dir("dataset", "synthetic", make_dir(tmp_path / "up", {"x": b"1"}))
    before = datetime.now(timezone.utc)
    ref = store.put_dir("model", "sft-a", src, inputs={"data": upstream, "base": "Qwen/Qwen2.5-0.5B"},
                        config_hash="cfg123", metadata={"step": 10})
    after = datetime.now(timezone.utc)
    m = store.manifest(ref)
    assert (m.kind, m.name, m.version, m.ref) == ("model", "sft-a", ref.version, ref)
    assert m.inputs == {"data": str(upstream), "base": "Qwen/Qwen2.5-0.5B"}
    assert (m.config_hash, m.metadata) == ("cfg123", {"step": 10})
    assert before <= datetime.fromisoformat(m.created) <= after
    assert m.code_version == code_version() and m.code_version
    assert m.files == {rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                       for rel, data in NESTED.items()}


def test_versions_latest_and_artifacts(store, tmp_path):
    refs = [store.put_dir("checkpoint", "run", make_dir(tmp_path / str(i), {"w": bytes([i])})) for i in range(3)]
    store.put_dir("dataset", "other", make_dir(tmp_path / "o", {"d": b"d"}))
    assert [m.ref for m in store.versions("checkpoint", "run")] == refs
    assert store.latest("checkpoint", "run") == refs[2]
    store.put_dir("checkpoint", "run", tmp_path / "0")  # same content again: still the oldest
    assert store.latest("checkpoint", "run") == refs[2]
    assert store.latest("checkpoint", "missing") is None and store.versions("nothing", "here") == []
    assert store.artifacts() == [("checkpoint", "run"), ("dataset", "other")]
    assert store.artifacts("dataset") == [("dataset", "other")]


def test_delete(store, tmp_path):
    old, new = (store.put_dir("checkpoint", "run", make_dir(tmp_path / s, {"w": s.encode()})) for s in "ab")
    store.delete(old)
    assert not store.exists(old) and store.exists(new)
    assert [m.ref for m in store.versions("checkpoint", "run")] == [new]
    assert store.gc() == 0  # delete left nothing behind
    with pytest.raises(FileNotFoundError, match=str(old)):
        store.get_dir(old)
    with pytest.raises(FileNotFoundError, match=str(old)):
        store.delete(old)


def test_tables(store):
    store.write_bytes("runs/r1/metrics/step_0001.parquet", b"one")
    store.write_bytes("runs/r1/metrics/step_0002.parquet", b"two")
    store.write_bytes("runs/r1/metrics/step_0001.parquet", b"one again")  # rewritten on resume
    store.write_bytes("runs/r1/notes.txt", b"n")
    assert store.read_bytes("runs/r1/metrics/step_0001.parquet") == b"one again"
    assert store.glob("runs/r1/metrics/*.parquet") == ["runs/r1/metrics/step_0001.parquet",
                                                       "runs/r1/metrics/step_0002.parquet"]
    assert store.glob("runs/r1/*") == ["runs/r1/metrics", "runs/r1/notes.txt"]
    with pytest.raises(FileNotFoundError):
        store.read_bytes("runs/r1/missing")
    for bad in ["../escape", "/abs", "artifacts/dataset/x", ".staging/x", "a//b"]:
        with pytest.raises(ValueError, match="relpath="):
            store.write_bytes(bad, b"x")


def test_url_and_storage_options_open_with_pandas(store):
    frame = pd.DataFrame({"step": [1, 2], "reward": [0.5, 0.75]})
    store.write_bytes("runs/r1/metrics.parquet", frame.to_parquet())
    url = store.url("runs/r1/metrics.parquet")
    assert url.startswith("s3://") if store.is_remote else Path(url).is_absolute()
    assert store.storage_options() == ({"endpoint_url": store.endpoint_url} if store.is_remote else {})
    pd.testing.assert_frame_equal(pd.read_parquet(url, storage_options=store.storage_options() or None), frame)


def test_crash_mid_write_leaves_no_version_and_gc_cleans(store, tmp_path, monkeypatch):
    src = make_dir(tmp_path / "src", NESTED)
    written = crash_after_first_file(monkeypatch)
    monkeypatch.setattr(ArtifactStore, "_discard", lambda self, path: None)  # a hard crash runs no cleanup
    with pytest.raises(StoreError if store.is_remote else Crash, match="simulated crash"):
        store.put_dir("dataset", "synthetic", src)
    assert len(written) == 1 and store.fs.exists(written[0])  # the partial write is really there...
    assert store.artifacts() == [] and store.versions("dataset", "synthetic") == []  # ...and invisible
    assert store.latest("dataset", "synthetic") is None
    assert store.sweep().num_fresh_leftovers == 1 and store.fs.exists(written[0])  # fresh: it may be a live write
    assert store.gc(now=True) == 1 and not store.fs.exists(written[0])  # gc --now: nothing writes, it goes
    assert store.gc(now=True) == 0
    monkeypatch.undo()
    ref = store.put_dir("dataset", "synthetic", src)  # a retry commits
    assert [m.ref for m in store.versions("dataset", "synthetic")] == [ref]


def test_a_failed_write_leaves_no_version_and_what_it_sent_goes_later(store, tmp_path, monkeypatch):
    """Local: the staging folder goes at once. S3: the files sent stay, invisible, until a retry overwrites them or
    gc finds them untouched for its age (removing them at once could delete a concurrent writer's: test_store_s3)."""
    written = crash_after_first_file(monkeypatch)
    with pytest.raises((Crash, StoreError)):
        store.put_dir("dataset", "synthetic", make_dir(tmp_path / "src", NESTED))
    assert store.artifacts() == [] and store.gc() == 0
    assert store.fs.exists(written[0]) == store.is_remote
    if store.is_remote:
        assert store.gc(now=True) == 1 and not store.fs.exists(written[0])


def test_reader_never_sees_a_manifest_less_version(store, tmp_path, monkeypatch):
    src = make_dir(tmp_path / "src", NESTED)
    seen, original = [], ArtifactStore._write_file

    def write_and_look(self, src_file, dest):  # a reader looking at every moment of the write
        original(self, src_file, dest)
        seen.append((store.versions("dataset", "synthetic"), store.artifacts(), store.latest("dataset", "synthetic")))

    monkeypatch.setattr(ArtifactStore, "_write_file", write_and_look)
    ref = store.put_dir("dataset", "synthetic", src)
    assert seen == [([], [], None)] * len(NESTED)
    assert store.latest("dataset", "synthetic") == ref
    # Files of a version without its manifest, as left by a crashed upload: not a version.
    orphan = ArtifactRef("dataset", "synthetic", "0" * 16)
    orphan_dir = f"{store.url('x').rsplit('/', 1)[0]}/artifacts/dataset/synthetic/{orphan.version}"
    store.fs.makedirs(orphan_dir, exist_ok=True)
    store.fs.pipe_file(f"{orphan_dir}/w", b"w")
    assert not store.exists(orphan) and store.latest("dataset", "synthetic") == ref
    with pytest.raises(FileNotFoundError, match=str(orphan)):
        store.get_dir(orphan)


def test_get_dir_reuses_a_complete_copy(store, tmp_path, monkeypatch):
    ref = store.put_dir("model", "m", make_dir(tmp_path / "src", NESTED))
    dest = store.get_dir(ref, dest=tmp_path / "dest")
    monkeypatch.setattr(type(store.fs), "get_file", lambda *a, **k: pytest.fail("downloaded again"))
    assert store.get_dir(ref, dest=dest) == dest
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("not an artifact")
    with pytest.raises(ValueError, match="not a complete copy"):
        store.get_dir(ref, dest=tmp_path / "busy")


def test_a_download_whose_partial_folder_vanished_midway_fails_instead_of_landing_incomplete(store, tmp_path,
                                                                                            monkeypatch):
    """`gc --now` (of any store: the cache is shared) removes partial downloads; the next file recreated the folder,
    and the copy without the first files was renamed into place as complete."""
    import shutil

    import infra.store_reads as reads

    ref = store.put_dir("model", "m", make_dir(tmp_path / "src", {f"shard{i}.bin": bytes([i]) * 100 for i in range(4)}))
    hashed, real = [], reads.file_sha256

    def sha_then_sweep(path, *args):
        hashed.append(path)
        digest = real(path, *args)
        if len(hashed) == 2:
            shutil.rmtree(Path(path).parent)  # the sweep, between two files
        return digest

    monkeypatch.setattr(reads, "file_sha256", sha_then_sweep)
    with pytest.raises(RuntimeError, match=r"lost files while it ran \(shard0.bin: missing.*gc --now"):
        store.get_dir(ref, dest=tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
    monkeypatch.setattr(reads, "file_sha256", real)
    assert sorted(p.name for p in store.get_dir(ref, dest=tmp_path / "dest").iterdir()) == [
        MANIFEST, "shard0.bin", "shard1.bin", "shard2.bin", "shard3.bin"]


def test_bad_inputs(store, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not a folder"):
        store.put_dir("dataset", "d", tmp_path / "missing")
    with pytest.raises(ValueError, match="has no files"):
        store.put_dir("dataset", "d", tmp_path / "empty")
    with pytest.raises(ValueError, match="reserved"):
        store.put_dir("dataset", "d", make_dir(tmp_path / "m", {MANIFEST: b"{}"}))
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        store.put_dir("dataset", "d", make_dir(tmp_path / "ok", {"a": b"a"}), metadata={"x": object()})
    with pytest.raises(ValueError, match="name='a/b'"):
        store.put_dir("dataset", "a/b", tmp_path / "ok")
    assert store.artifacts() == []


# ---------------------------------------------------------------------------------------------- local only


def test_local_check_names_the_root(tmp_path):
    ArtifactStore(str(tmp_path / "new" / "store")).check()
    assert (tmp_path / "new" / "store").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="storage.root=.*file/store"):
        ArtifactStore(str(tmp_path / "file" / "store")).check()


def test_local_write_bytes_leaves_no_temp_files(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    for i in range(3):
        store.write_bytes("t/x.bin", bytes([i]))
    assert sorted(os.listdir(tmp_path / "store" / "t")) == ["x.bin"]


def test_cli_shows_versions_and_lineage(tmp_path):
    root = str(tmp_path / "store")
    store = ArtifactStore(root)
    data = store.put_dir("dataset", "synthetic", make_dir(tmp_path / "d", {"train.parquet": b"rows"}))
    model = store.put_dir("model", "sft-a", make_dir(tmp_path / "m", {"w.bin": b"w"}),
                          inputs={"data": data, "base": "Qwen/Qwen2.5-0.5B"}, metadata={"step": 10})

    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "infra.store", "--root", root, *args], cwd=PROJECT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    out = cli("versions", "model/sft-a")
    assert str(model) in out and f"data={data}" in out and "base=Qwen/Qwen2.5-0.5B" in out and '"step": 10' in out
    out = cli("show", str(model))
    assert json.loads(out.split("lineage:")[0])["inputs"]["data"] == str(data)
    assert f"data <- {data}" in out and "base <- Qwen/Qwen2.5-0.5B (external)" in out
    assert cli("list").splitlines() == [f"dataset/synthetic  versions=1  latest={data}",
                                        f"model/sft-a  versions=1  latest={model}"]
    assert cli("gc").startswith("removed 0 leftovers of crashed artifact writes")


def test_table_files_are_as_readable_as_artifacts(tmp_path):
    """write_bytes and create_exclusive go through a temp file: it must not leave them owner-only (mkstemp's 0600)
    when the artifacts beside them follow the umask (a teammate's SQL over a shared store would skip them)."""
    import os
    import stat

    store = ArtifactStore(str(tmp_path / "store"))
    store.write_bytes("rollouts/run_id=r/step=1/part-0.parquet", b"x")
    store.create_exclusive("leases/x.json", b"{}")
    umask = os.umask(0o022)
    os.umask(umask)
    for rel in ("rollouts/run_id=r/step=1/part-0.parquet", "leases/x.json"):
        mode = stat.S_IMODE((tmp_path / "store" / rel).stat().st_mode)
        assert mode == 0o666 & ~umask, (rel, oct(mode))


def test_a_root_under_an_unknown_user_is_a_config_error_naming_storage_root(tmp_path, capsys):
    from flows.post_train import main

    with pytest.raises(ValueError, match=r"storage\.root='~no-such-user-rlpipe/x': there is no user "
                                         r"'no-such-user-rlpipe' on this machine.*Fix: "):
        ArtifactStore("~no-such-user-rlpipe/x")
    assert main(["storage.root=~no-such-user-rlpipe/x", f"run.output_dir={tmp_path / 'out'}"]) == 2
    assert capsys.readouterr().err.startswith("error: storage.root='~no-such-user-rlpipe/x': there is no user")
    assert not (tmp_path / "out").exists()


def test_a_root_with_glob_characters_is_a_config_error_before_anything_is_written(tmp_path, monkeypatch):
    """In `[1]` a glob reads a character class: gc found no committed version under such a root and removed every
    one as an abandoned upload; reads and tables saw nothing."""
    with pytest.raises(ConfigError, match=r"storage\.root = '.*store\[1\]': \[ \] in the path.*Fix: "):
        load_config(None, [f"storage.root={tmp_path / 'store[1]'}"])
    with pytest.raises(ValueError, match=r"storage\.root='s3://b/run\*'.*\* in the path"):
        ArtifactStore("s3://b/run*")
    folder = tmp_path / "proj[2]"  # a relative root under such a working folder
    folder.mkdir()
    monkeypatch.chdir(folder)
    with pytest.raises(ValueError, match=r"storage\.root='outputs/store' \(resolved: '.*proj\[2\]/outputs/store'\)"):
        ArtifactStore("outputs/store")
    assert list(folder.iterdir()) == []


def test_a_bad_aws_endpoint_url_is_a_config_error_before_the_flow(tmp_path, capsys, monkeypatch):
    """AWS_ENDPOINT_URL is read by the store, not the config: its error must still stop the command line (exit 2)."""
    from flows.post_train import main

    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:9000")
    assert main(["storage.root=s3://bucket/p", f"run.output_dir={tmp_path / 'out'}"]) == 2
    assert capsys.readouterr().err.startswith("error: endpoint_url='127.0.0.1:9000' (storage.endpoint_url, ")
