"""gc: leftovers of crashed artifact writes (staging and manifest-less version folders), temp files of table writes
and partial downloads left by a SIGKILL are removed once untouched for longer than any live writer leaves them (never
a write in progress; `gc --now` at once), and versions whose manifest is corrupt (invisible, so checkpoint pruning
never removes them) are reported, and removed only when asked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from infra import store_gc
from infra.artifacts import MANIFEST
from infra.checkpoints import StoreCheckpoints
from infra.config_sections import StorageConfig
from infra.store import GC_MIN_AGE_S, ArtifactStore
from infra.store_base import PARTIAL
from infra.store_cli import main as cli
from tests.unit.test_store_cli import root_args, run
from tests.unit.test_store_integrity import make_dir, save_steps, stored_path

PROJECT = Path(__file__).resolve().parents[2]


def age(path: Path, seconds: float) -> None:
    """Set the mtime of path (and of everything under a folder) to `seconds` ago."""
    when = time.time() - seconds
    for p in [path, *(path.rglob("*") if path.is_dir() else [])]:
        os.utime(p, (when, when))


def test_min_age_is_an_hour_or_twice_the_longest_silent_s3_request():
    assert ArtifactStore("x").temp_min_age_s == GC_MIN_AGE_S == 3600  # defaults: 2 * 18 s of stall_bound_s < 1 h
    slow = StorageConfig(timeout_s=600, max_attempts=10)
    # stall_bound_s: 10 attempts x 600 s + backoffs 1 + 2 + 4 + 8 + 16 + 20 x 4 = 6111 s
    assert ArtifactStore("x", limits=slow).temp_min_age_s == 2 * 6111


def test_a_temp_file_left_by_a_sigkill_is_removed_once_stale(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"), cache_dir=tmp_path / "cache")
    store.write_bytes("runs/r/config.yaml", b"old")
    child = subprocess.Popen(  # write_bytes killed after its temp file is written, before the rename
        [sys.executable, "-c", "import os, sys, time\nfrom infra.store import ArtifactStore\n"
         "os.replace = lambda *a: (print('written', flush=True), time.sleep(60))\n"
         f"ArtifactStore({store.root!r}).write_bytes('runs/r/config.yaml', b'new')"],
        cwd=PROJECT, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "written\n"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    [tmp] = (tmp_path / "store" / "runs" / "r").glob(".config.yaml.*.tmp")
    assert tmp.read_bytes() == b"new" and store.read_bytes("runs/r/config.yaml") == b"old"
    report = store.sweep()
    assert (report.temp_files, report.num_fresh_temp, store.gc()) == ([], 1, 0)  # it might be a live write
    age(tmp, GC_MIN_AGE_S + 60)
    report = store.sweep()
    assert (report.temp_files, report.num_fresh_temp, report.num_removed) == ([str(tmp)], 0, 1)
    assert not tmp.exists() and store.read_bytes("runs/r/config.yaml") == b"old"
    assert store.gc() == 0


def test_only_stale_temp_files_and_partial_downloads_go(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"), cache_dir=tmp_path / "cache")
    root, cache = tmp_path / "store", tmp_path / "cache"
    ref = store.put_dir("dataset", "d", make_dir(tmp_path / "src", {".keep.tmp": b"a version's own file"}))
    store.write_bytes("leases/x.json", b"{}")
    stale_tmp = make_dir(root, {"leases/.x.json.a1b2c3d4.tmp": b"{"}) / "leases/.x.json.a1b2c3d4.tmp"
    live_tmp = make_dir(root, {"rollouts/run_id=r/.part-0.parquet.c3d4e_f6.tmp": b"P"}) / \
        "rollouts/run_id=r/.part-0.parquet.c3d4e_f6.tmp"
    foreign_tmp = make_dir(root, {"notes/.draft.tmp": b"another tool's"}) / "notes/.draft.tmp"  # not mkstemp's shape
    stale_partial = make_dir(cache / "model/m/.0123456789abcdef.partial-x1", {"a/w.bin": b"w"})
    live_partial = make_dir(cache / "model/m/.fedcba9876543210.partial-x2", {"a/w.bin": b"w", "b.bin": b"b"})
    for path in (stale_tmp, foreign_tmp, stale_partial, live_partial, root / "artifacts", root / "leases/x.json"):
        age(path, GC_MIN_AGE_S + 60)
    age(live_tmp, GC_MIN_AGE_S - 60)
    age(live_partial / "b.bin", GC_MIN_AGE_S - 60)  # a download still writing its second file
    report = store.sweep()
    assert sorted(report.temp_files) == sorted([str(stale_tmp), str(stale_partial)])
    assert (report.leftovers, report.corrupt, report.num_fresh_temp, report.num_removed) == ([], [], 2, 2)
    assert not stale_tmp.exists() and not stale_partial.exists() and live_tmp.exists() and live_partial.exists()
    assert foreign_tmp.exists()
    assert store.read_bytes("leases/x.json") == b"{}" and store.verify(ref).ref == ref


def test_checkpoints_with_a_corrupt_manifest_are_reported_and_removed_only_when_asked(store, tmp_path, capsys):
    ckpts = StoreCheckpoints(store, "rl-k", max_to_keep=2)
    refs = save_steps(ckpts, tmp_path, [1, 2])
    store.fs.pipe_file(stored_path(store, refs[1], MANIFEST), b"{")  # step 1's manifest damaged
    refs |= save_steps(ckpts, tmp_path / "later", [3, 4])
    # Pruning keeps the newest 2 (steps 3, 4) and removed step 2; step 1 is invisible to it and stays forever.
    assert store.manifest_refs("checkpoint", "rl-k") == sorted([refs[1], refs[3], refs[4]], key=str)
    report = store.sweep()
    assert (report.corrupt, report.corrupt_removed, report.num_removed) == ([refs[1]], False, 0)
    assert store.manifest_refs("checkpoint", "rl-k") == sorted([refs[1], refs[3], refs[4]], key=str)
    code, out, _ = run(capsys, cli, *root_args(store), "gc")
    assert code == 0 and f"kept 1 versions with a corrupt manifest: {refs[1]}" in out and "gc --corrupt" in out
    code, out, _ = run(capsys, cli, *root_args(store), "gc", "--corrupt")
    assert code == 0 and f"removed 1 versions with a corrupt manifest: {refs[1]}" in out
    assert store.manifest_refs("checkpoint", "rl-k") == sorted([refs[3], refs[4]], key=str)
    assert not store.fs.exists(store._vdir(refs[1]))
    assert ckpts.latest_ref() == refs[4] and store.sweep(remove_corrupt=True).num_removed == 0


def test_a_version_without_its_manifest_yet_is_never_called_corrupt(store, tmp_path):
    """An upload in flight has its files but no manifest: gc's leftover rule (gone once untouched for an hour) is
    the one that covers it, never the corrupt-manifest one."""
    ref = store.put_dir("checkpoint", "c", make_dir(tmp_path / "src", {"w": b"w"}))
    store.fs.rm_file(stored_path(store, ref, MANIFEST))
    report = store.sweep(remove_corrupt=True)
    assert (report.corrupt, report.leftovers, report.num_fresh_leftovers) == ([], [], 1)
    report = store.sweep(remove_corrupt=True, now=True)
    assert (report.corrupt, report.leftovers) == ([], [store._vdir(ref)])


def test_a_fresh_staging_folder_survives_gc_and_a_stale_one_goes(tmp_path):
    """A flow writing while gc runs keeps its version in progress: a staging or manifest-less version folder goes
    only once every file in it is older than the threshold (the rule of temp files and partial downloads)."""
    store = ArtifactStore(str(tmp_path / "store"), cache_dir=tmp_path / "cache")
    root = tmp_path / "store"
    live = make_dir(root / ".staging/0a1b", {"w.bin": b"w", "sub/x.bin": b"x"})
    writing = make_dir(root / ".staging/2c3d", {"old.bin": b"o", "new.bin": b"n"})  # one file old, one just written
    stale = make_dir(root / ".staging/4e5f", {"w.bin": b"w", "sub/x.bin": b"x"})
    orphan = make_dir(root / "artifacts/model/m/0123456789abcdef", {"w.bin": b"w"})  # no manifest: an S3 upload
    for path in (writing / "old.bin", stale, orphan):
        age(path, GC_MIN_AGE_S + 60)
    report = store.sweep()
    assert sorted(report.leftovers) == sorted([str(stale), str(orphan)])
    assert (report.num_fresh_leftovers, report.num_removed, report.min_age_s) == (2, 2, GC_MIN_AGE_S)
    assert live.is_dir() and writing.is_dir() and not stale.exists() and not orphan.exists()
    assert (live / "sub/x.bin").read_bytes() == b"x" and (writing / "old.bin").read_bytes() == b"o"


def test_leftovers_go_an_hour_later_on_each_backend(store, tmp_path, monkeypatch):
    """The age comes from the storage: a local file's mtime, an S3 object's LastModified (moto's, which os.utime
    cannot set: the clock moves instead)."""
    ref = store.put_dir("checkpoint", "c", make_dir(tmp_path / "src", {"w": b"w", "v": b"v"}))
    store.fs.rm_file(stored_path(store, ref, MANIFEST))  # an upload without its manifest yet
    assert store.gc() == 0 and store.fs.exists(stored_path(store, ref, "w"))
    later = time.time() + GC_MIN_AGE_S + 60
    monkeypatch.setattr(store_gc, "time", SimpleNamespace(time=lambda: later))
    assert store.sweep().leftovers == [store._vdir(ref)] and not store.fs.exists(store._vdir(ref))


def test_the_cli_removes_fresh_leftovers_only_with_now(tmp_path, capsys):
    store = ArtifactStore(str(tmp_path / "store"), cache_dir=tmp_path / "cache")
    staging = make_dir(tmp_path / "store/.staging/0a1b", {"w.bin": b"w"})
    code, out, _ = run(capsys, cli, *root_args(store), "gc")
    assert code == 0 and out.splitlines()[0] == (
        f"removed 0 leftovers of crashed artifact writes (staging and manifest-less version folders) untouched for "
        f"over {GC_MIN_AGE_S:.0f} s (kept 1 younger ones: a write may be running)") and staging.is_dir()
    code, out, _ = run(capsys, cli, *root_args(store), "gc", "--now")
    assert code == 0 and out.splitlines()[0] == (
        "removed 1 leftovers of crashed artifact writes (staging and manifest-less version folders) untouched for "
        "over 0 s (kept 0 younger ones: a write may be running)") and not staging.exists()


def test_the_cli_reports_each_kind_of_leftover(tmp_path, capsys):
    store = ArtifactStore(str(tmp_path / "store"), cache_dir=tmp_path / "cache")
    store.write_bytes("runs/r/config.yaml", b"x")
    code, out, _ = run(capsys, cli, *root_args(store), "gc")
    assert (code, out.splitlines()) == (0, [
        "removed 0 leftovers of crashed artifact writes (staging and manifest-less version folders) untouched for "
        f"over {GC_MIN_AGE_S:.0f} s (kept 0 younger ones: a write may be running)",
        f"removed 0 temp files and partial downloads untouched for over {GC_MIN_AGE_S:.0f} s "
        "(kept 0 younger ones: a write may be running)",
        "0 versions with a corrupt manifest"])


def test_a_failed_download_into_a_folder_of_ones_own_leaves_nothing(store, tmp_path, monkeypatch):
    """get_dir(ref, dest) downloads beside dest and renames: a read failing midway leaves no dest (which would look
    complete to a later reader of the folder) and no partial folder."""
    ref = store.put_dir("model", "m", make_dir(tmp_path / "src", {"a.bin": b"a", "b/c.bin": b"c", "d.bin": b"d"}))
    fetched, original = [], store.fs.get_file

    def fail_second(rpath, lpath, **kwargs):
        fetched.append(rpath)
        if len(fetched) == 2:
            raise ConnectionResetError("connection reset by peer")
        return original(rpath, lpath, **kwargs)

    monkeypatch.setattr(store.fs, "get_file", fail_second)  # s3fs: an instance attribute (fsspec's sync mirror)
    dest = tmp_path / "mine" / "model"
    with pytest.raises(ConnectionResetError):
        store.get_dir(ref, dest=dest)
    assert len(fetched) == 2 and not dest.exists() and list(dest.parent.iterdir()) == []
    monkeypatch.undo()
    assert store.get_dir(ref, dest=dest) == dest and (dest / "b/c.bin").read_bytes() == b"c"


def test_a_killed_download_beside_ones_own_folder_goes_at_the_next_get_dir(tmp_path):
    """gc sees only the cache's partial downloads; one that a SIGKILL left beside a caller's dest goes at the next
    get_dir into that dest, by gc's rule (untouched for temp_min_age_s), never a live one or another dest's."""
    store = ArtifactStore(str(tmp_path / "store"), cache_dir=tmp_path / "cache")
    ref = store.put_dir("model", "m", make_dir(tmp_path / "src", {"a.bin": b"a", "b/c.bin": b"c"}))
    mine = tmp_path / "mine"
    stale = make_dir(mine / f".model{PARTIAL}k1ll3d", {"a.bin": b"a"})
    live = make_dir(mine / f".model{PARTIAL}l1v3", {"a.bin": b"a"})
    other = make_dir(mine / f".model-b{PARTIAL}0th3r", {"a.bin": b"a"})  # another dest's: its own get_dir decides
    for path in (stale, other):
        age(path, GC_MIN_AGE_S + 60)
    assert store.get_dir(ref, dest=mine / "model") == mine / "model"
    assert sorted(p.name for p in mine.iterdir()) == sorted(["model", live.name, other.name])
