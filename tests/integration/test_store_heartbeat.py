"""gc running beside an S3 upload (the local S3 server), with gc's age shrunk from an hour to AGE_S seconds and the
heartbeat's interval with it (a sixth): an upload whose one file takes longer than the age to send commits intact,
and a killed writer's folder still goes once older than the age.

S3 gives LastModified in whole seconds, so a beat looks up to 1 s older than it is; AGE_S = 4 leaves room for that,
the 0.67 s interval and a slow request on a busy machine."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from infra.artifacts import ArtifactRef, hash_dir
from infra.store import ArtifactStore
from infra.store_base import HEARTBEAT

pytestmark = pytest.mark.s3

PROJECT = Path(__file__).resolve().parents[2]
AGE_S = 4.0
FILES = {"a.bin": b"a" * 1000, "b.bin": b"b" * 1000, "c.bin": b"c" * 1000}  # uploaded in this order


def make_dir(root: Path) -> Path:
    root.mkdir()
    for rel, data in FILES.items():
        (root / rel).write_bytes(data)
    return root


@pytest.fixture
def stores(s3_server, tmp_path, monkeypatch) -> tuple[ArtifactStore, ArtifactStore]:
    """A writer and a gc (another process's store) on the same bucket and prefix, both with gc's age AGE_S."""
    monkeypatch.setattr(ArtifactStore, "temp_min_age_s", AGE_S)
    root = f"s3://{s3_server.create_bucket()}/p"
    return (ArtifactStore(root, s3_server.endpoint_url, tmp_path / "cache-w"),
            ArtifactStore(root, s3_server.endpoint_url, tmp_path / "cache-gc"))


def test_an_upload_whose_one_file_outlasts_the_gc_age_commits_intact(stores, tmp_path, monkeypatch):
    """b.bin takes AGE_S + 2 s to send (an S3 object appears only once sent whole: the sleep comes before its PUT),
    while gc sweeps every 0.2 s. Without the heartbeat gc removes a.bin meanwhile and the version commits corrupt."""
    writer, collector = stores
    upload = ArtifactStore._write_file

    def slow_b(self, src, dest):
        if dest.endswith("/b.bin"):
            time.sleep(AGE_S + 2)
        upload(self, src, dest)

    monkeypatch.setattr(ArtifactStore, "_write_file", slow_b)
    done, reports, errors = threading.Event(), [], []

    def collect():
        while not done.is_set():
            try:
                reports.append(collector.sweep())
            except Exception as exc:  # raised again in the test's thread below
                errors.append(exc)
                return
            time.sleep(0.2)

    gc_thread = threading.Thread(target=collect)
    gc_thread.start()
    try:
        ref = writer.put_dir("model", "big", make_dir(tmp_path / "src"))
    finally:
        done.set()
        gc_thread.join()
    assert errors == []
    assert len(reports) >= 5 and [r.leftovers for r in reports if r.leftovers] == []  # never taken for dead...
    assert any(r.num_fresh_leftovers for r in reports)  # ...though seen in flight
    assert writer.verify(ref).files.keys() == FILES.keys()
    copy = collector.get_dir(ref, dest=tmp_path / "copy")
    assert {rel: (copy / rel).read_bytes() for rel in FILES} == FILES
    assert not writer.fs.exists(f"{writer._vdir(ref)}/{HEARTBEAT}") and collector.gc() == 0


def test_a_killed_writers_folder_goes_once_older_than_the_age(stores, s3_server, tmp_path):
    """A writer SIGKILLed while b.bin is on its way: its heartbeat kept the folder fresh while it lived (a.bin alone
    is older than the age by then), stops with it, and gc removes the folder, heartbeat included, after the age."""
    writer, collector = stores
    src = make_dir(tmp_path / "src")
    vdir = collector._vdir(ArtifactRef("model", "big", hash_dir(src)[0]))
    child = subprocess.Popen(  # put_dir in another process, stuck in b.bin's upload until killed
        [sys.executable, "-c", "import sys, time\nfrom infra.store import ArtifactStore\n"
         f"ArtifactStore.temp_min_age_s = {AGE_S}\n"
         "upload = ArtifactStore._write_file\n"
         "def stuck(self, src, dest):\n"
         "    if dest.endswith('/b.bin'):\n"
         "        print('sending b.bin', flush=True)\n"
         "        time.sleep(600)\n"
         "    upload(self, src, dest)\n"
         "ArtifactStore._write_file = stuck\n"
         f"ArtifactStore({writer.root!r}, {writer.endpoint_url!r}).put_dir('model', 'big', {str(src)!r})"],
        cwd=PROJECT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "sending b.bin\n"
        time.sleep(AGE_S + 1.5)  # a.bin, sent before, is older than the age now
        report = collector.sweep()
        assert (report.leftovers, report.num_fresh_leftovers) == ([], 1)  # alive: its heartbeat is fresh
        assert collector.fs.exists(f"{vdir}/a.bin") and collector.fs.exists(f"{vdir}/{HEARTBEAT}")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert collector.sweep().leftovers == []  # just killed: as fresh as a live write
    time.sleep(AGE_S + 1.5)  # + LastModified's whole second and the last beat's request
    assert collector.sweep().leftovers == [vdir] and not collector.fs.exists(vdir)
