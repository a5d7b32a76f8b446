"""Every read of an artifact is checked against its manifest, on a local folder and on S3: a file zeroed in place
(same size), truncated, deleted, or a stray file added is a CorruptArtifactError naming the version, the file,
expected vs found and the fix; a corrupt manifest hides its version from listings (with a warning naming it) and
the CLI verifies and deletes. Checkpoints: resume falls back to the newest intact one and says so."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from infra.artifacts import MANIFEST
from infra.checkpoints import StoreCheckpoints
from infra.store import ArtifactStore, CorruptArtifactError
from infra.store_cli import main as cli

BLOB = bytes(range(256)) * 8  # 2 KiB, no run of zeros: zeroing part of it changes it
ARTIFACTS = {
    "checkpoint": {"actor/__0_0.distcp": BLOB, "actor/.metadata": b"meta", "trainer.pt": b"state"},
    "dataset": {"train.parquet": BLOB, "validation.parquet": b"rows"},
}


def make_dir(root, files: dict[str, bytes]):
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def stored_path(store: ArtifactStore, ref, rel: str) -> str:
    return f"{store._vdir(ref)}/{rel}"


def zero_bytes(store, path):
    data = bytearray(store.fs.cat_file(path))
    data[256:768] = bytes(512)  # same size, 512 bytes zeroed
    store.fs.pipe_file(path, bytes(data))
    return f"sha256 {hashlib.sha256(data).hexdigest()}, expected {hashlib.sha256(BLOB).hexdigest()}"


def truncate(store, path):
    store.fs.pipe_file(path, BLOB[:1000])
    return f"1000 bytes, expected {len(BLOB)}"


def delete_file(store, path):
    store.fs.rm_file(path)
    return "missing (the manifest lists it)"


def add_stray(store, path):
    store.fs.pipe_file(f"{path}.bak", b"x")
    return "not in the manifest (a stray file)"


DAMAGE = {"zeroed": zero_bytes, "truncated": truncate, "deleted": delete_file, "stray": add_stray}


@pytest.mark.parametrize("kind", list(ARTIFACTS))
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_files_are_caught_on_every_read(store, tmp_path, kind, damage):
    files = ARTIFACTS[kind]
    ref = store.put_dir(kind, "a", make_dir(tmp_path / "src", files))
    rel = next(iter(files))  # the 2 KiB file
    found = DAMAGE[damage](store, stored_path(store, ref, rel))
    bad = f"{rel}.bak" if damage == "stray" else rel
    for read in (store.get_dir, lambda r: store.get_dir(r, dest=tmp_path / "copy"), store.verify):
        with pytest.raises(CorruptArtifactError) as info:
            read(ref)
        message = str(info.value)
        assert f"{ref} at storage.root=" in message and f"{bad}: {found}" in message, message
        assert f"verify {ref}`" in message and f"delete {ref}`" in message  # the fix, as commands
    assert not (tmp_path / "copy").exists() and not list(tmp_path.glob(".copy.partial-*"))  # no partial copy
    if store.is_remote:
        assert list((tmp_path / "cache" / kind / "a").iterdir()) == []


def test_intact_versions_pass_and_damaged_cache_is_replaced(store, tmp_path):
    ref = store.put_dir("model", "m", make_dir(tmp_path / "src", ARTIFACTS["dataset"]))
    assert store.verify(ref).ref == ref
    folder = store.get_dir(ref)
    assert (folder / "train.parquet").read_bytes() == BLOB
    if store.is_remote:  # the cached copy is re-used as long as it is complete, replaced when damaged
        (folder / "train.parquet").write_bytes(b"short")
        assert (store.get_dir(ref) / "train.parquet").read_bytes() == BLOB


BAD_MANIFESTS = {
    "not json": lambda m: b"{not json",
    "missing field": lambda m: json.dumps({k: v for k, v in m.items() if k != "files"}).encode(),
    "wrong type": lambda m: json.dumps({**m, "files": {"w": {"size": "1", "sha256": "0" * 64}}}).encode(),
    "path escapes": lambda m: json.dumps({**m, "files": {"../w": {"size": 1, "sha256": "0" * 64}}}).encode(),
    "other version": lambda m: json.dumps({**m, "version": "0" * 16}).encode(),
}


@pytest.mark.parametrize("bad", list(BAD_MANIFESTS))
def test_corrupt_manifest_is_invisible_and_named(store, tmp_path, caplog, bad):
    good = store.put_dir("dataset", "d", make_dir(tmp_path / "good", {"w": b"good"}))
    src = make_dir(tmp_path / "src", {"w": b"w"})
    ref = store.put_dir("dataset", "d", src)
    path = stored_path(store, ref, MANIFEST)
    store.fs.pipe_file(path, BAD_MANIFESTS[bad](json.loads(store.fs.cat_file(path))))
    with caplog.at_level(logging.WARNING, logger="infra.store"):
        assert [m.ref for m in store.versions("dataset", "d")] == [good] and store.latest("dataset", "d") == good
    assert f"skipping {store._vdir(ref)} (treated as not committed)" in caplog.text
    assert not store.exists(ref)
    for read in (store.manifest, store.get_dir):
        with pytest.raises(CorruptArtifactError, match=f"{ref} at .* is corrupt: {MANIFEST}"):
            read(ref)
    assert store.gc() == 0  # a manifest is never a crash leftover
    assert store.put_dir("dataset", "d", src) == ref  # writing the same content again replaces it
    assert store.verify(ref).ref == ref


def test_cli_verify_reports_each_corrupt_version_and_delete_removes_it(store, tmp_path, capsys, caplog):
    root = ["--root", store.root] + (["--endpoint-url", store.endpoint_url] if store.endpoint_url else [])
    intact = store.put_dir("dataset", "d", make_dir(tmp_path / "a", {"w": b"a"}))
    zeroed = store.put_dir("checkpoint", "c", make_dir(tmp_path / "b", {"w": BLOB}))
    unreadable = store.put_dir("checkpoint", "c", make_dir(tmp_path / "c", {"w": b"c"}))
    zero_bytes(store, stored_path(store, zeroed, "w"))
    store.fs.pipe_file(stored_path(store, unreadable, MANIFEST), b"")
    with pytest.raises(SystemExit) as exit_status:
        cli([*root, "verify"])
    out = capsys.readouterr().out
    assert exit_status.value.code == 1
    assert f"ok       {intact}" in out and f"CORRUPT  {zeroed} " in out and f"CORRUPT  {unreadable} " in out
    assert "3 versions checked, 2 corrupt" in out
    cli([*root, "verify", "dataset/d"])
    assert "1 versions checked, 0 corrupt" in capsys.readouterr().out
    cli([*root, "list"])  # the unreadable manifest is skipped, not an error
    assert capsys.readouterr().out.splitlines() == [f"checkpoint/c  versions=1  latest={zeroed}",
                                                    f"dataset/d  versions=1  latest={intact}"]
    for ref in (zeroed, unreadable):
        cli([*root, "delete", str(ref)])
        assert capsys.readouterr().out.strip() == f"deleted {ref}"
    cli([*root, "verify"])
    assert "1 versions checked, 0 corrupt" in capsys.readouterr().out


# ---- checkpoints: resume falls back to the newest intact one ---------------------------------------------


def save_steps(ckpts: StoreCheckpoints, tmp_path, steps) -> dict:
    for step in steps:
        ckpts.save(step, make_dir(tmp_path / f"step{step}", {"w": BLOB + bytes([step]), "meta.json": b"{}"}))
    return {step: ckpts.at_step(step) for step in steps}


def test_resume_skips_corrupt_checkpoints(store, tmp_path, caplog):
    ckpts = StoreCheckpoints(store, "rl-x", max_to_keep=3)
    refs = save_steps(ckpts, tmp_path, [1, 2, 3])
    zero_bytes(store, stored_path(store, refs[3], "w"))
    with caplog.at_level(logging.WARNING, logger="infra.checkpoints"):
        folder = ckpts.latest()
    assert (folder / "w").read_bytes() == BLOB + bytes([2])
    assert f"checkpoint {refs[3]} (step 3) is corrupt, skipping it" in caplog.text
    assert f"resuming from checkpoint {refs[2]} at step 2, the newest intact one, instead of the corrupt " \
           f"{refs[3]} (step 3)" in caplog.text
    # the resumed run saves step 3 again (the same bytes, as an exact resume makes them): the save repairs it
    assert save_steps(ckpts, tmp_path / "again", [3])[3] == refs[3]
    assert store.verify(refs[3]) and (ckpts.latest() / "w").read_bytes() == BLOB + bytes([3])
    assert [m.ref for m in store.versions("checkpoint", "rl-x")] == [refs[1], refs[2], refs[3]]


def test_no_intact_checkpoint_starts_from_scratch(store, tmp_path, caplog):
    ckpts = StoreCheckpoints(store, "rl-x", max_to_keep=2)
    refs = save_steps(ckpts, tmp_path, [1, 2])
    truncate(store, stored_path(store, refs[1], "w"))
    delete_file(store, stored_path(store, refs[2], "w"))
    with caplog.at_level(logging.WARNING, logger="infra.checkpoints"):
        assert ckpts.latest() is None
    assert f"no intact checkpoint of rl-x (corrupt: {refs[2]} (step 2), {refs[1]} (step 1)): starting from " \
           "scratch" in caplog.text


def test_checkpoint_with_corrupt_manifest_is_skipped(store, tmp_path, caplog):
    ckpts = StoreCheckpoints(store, "rl-x", max_to_keep=3)
    refs = save_steps(ckpts, tmp_path, [1, 2])
    store.fs.pipe_file(stored_path(store, refs[2], MANIFEST), b"{")
    with caplog.at_level(logging.WARNING):
        assert (ckpts.latest() / "w").read_bytes() == BLOB + bytes([1])
    assert f"skipping {store._vdir(refs[2])}" in caplog.text


def test_saving_a_step_again_replaces_later_steps(store, tmp_path):
    """A run restarted (or resumed from an earlier checkpoint) supersedes what the abandoned run saved after."""
    ckpts = StoreCheckpoints(store, "rl-x", max_to_keep=3)
    refs = save_steps(ckpts, tmp_path, [1, 2, 3])
    again = save_steps(ckpts, tmp_path / "again", [2])[2]
    assert [m.ref for m in store.versions("checkpoint", "rl-x")] == [refs[1], again]
    assert ckpts.latest_ref() == again



def flip_byte(path) -> str:
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # bit rot: same size, same name
    path.write_bytes(bytes(data))
    return "actor/__0_0.distcp: sha256 "


def add_stray_file(path) -> str:
    (path.parent / "extra.bin").write_bytes(b"not in the manifest")
    return "actor/extra.bin: not in the manifest"


@pytest.mark.parametrize("damage", [flip_byte, add_stray_file], ids=lambda damage: damage.__name__)
def test_a_copy_changed_in_place_is_never_reused(store, tmp_path, caplog, damage):
    """A copy that get_dir made earlier is hashed again before it is re-used, as a local get_dir hashes the
    version: the cache's copy is downloaded again (with a warning naming the file), a given dest is refused."""
    ref = store.put_dir("checkpoint", "c", make_dir(tmp_path / "src", ARTIFACTS["checkpoint"]))
    rel = "actor/__0_0.distcp"  # the 2 KiB file
    dest = store.get_dir(ref, dest=tmp_path / "copy")
    found = damage(dest / rel)
    with pytest.raises(ValueError, match=f"is not a complete copy of {ref} \\({found}"):
        store.get_dir(ref, dest=dest)
    if not store.is_remote:
        return  # the local store has no cache: get_dir(ref) is the version itself, verified at every call
    cached = store.get_dir(ref)
    damage(cached / rel)
    with caplog.at_level(logging.WARNING, logger="infra.store"):
        again = store.get_dir(ref)
    assert again == cached and (again / rel).read_bytes() == BLOB
    assert sorted(p.name for p in again.rglob("*") if p.is_file()) == sorted(
        [MANIFEST, ".metadata", "__0_0.distcp", "trainer.pt"])  # the stray file went with the damaged copy
    [warning] = [r.getMessage() for r in caplog.records if r.name == "infra.store" and r.levelno >= logging.WARNING]
    assert f"the cached copy {cached} of {ref} is incomplete or damaged ({found}" in warning, warning
