"""The command lines of the store and of SQL name what is not there: a store root, an artifact, a version or a kind
that does not exist exits 2 (bad input) with a message naming it and the command that lists what exists, on a local
folder and on S3, and looking at a missing local root does not create it."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra import sql_cli
from infra.store import ArtifactStore
from infra.store_cli import main as store_cli

MISSING = "checkpoint/nope@0123456789abcdef"


def run(capsys, cli, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, the "error: " lines of stderr) of cli(argv) as `python -m` would give them:
    SystemExit("text") prints the text and exits 1. Other stderr lines are left out: the S3 server's request log
    can land there (through a handler that an earlier test's Prefect import left on the root logger)."""
    try:
        cli(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    if isinstance(code, str):
        code, err = 1, err + code
    return code, out, "\n".join(line for line in err.splitlines() if line.startswith("error: "))


def root_args(store: ArtifactStore) -> list[str]:
    return ["--root", store.root] + (["--endpoint-url", store.endpoint_url] if store.endpoint_url else [])


def missing_root(store: ArtifactStore) -> ArtifactStore:
    """A store beside `store` that nothing was written to: a folder that does not exist, an S3 prefix without
    objects."""
    root = store.root.rsplit("/", 1)[0] + "/never-written"
    return ArtifactStore(root, store.endpoint_url)


@pytest.mark.parametrize("command", [["list"], ["versions", "dataset/d"], ["show", MISSING], ["verify"],
                                     ["verify", "dataset/d"], ["delete", MISSING], ["gc"]])
def test_store_cli_on_a_missing_root_exits_2_naming_it(store, capsys, command):
    nowhere = missing_root(store)
    code, out, err = run(capsys, store_cli, *root_args(nowhere), *command)
    assert (code, out) == (2, "")
    assert f"there is no store at storage.root={nowhere.root!r}" in err and "--root" in err, err
    assert ("nothing is stored under that prefix" if store.is_remote else "no such folder") in err
    assert not Path(nowhere.root).exists()  # looking did not create it (a local root)


def test_store_cli_on_a_missing_artifact_exits_2_naming_it_and_how_to_list(store, tmp_path, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "w").write_bytes(b"w")
    ref = store.put_dir("dataset", "d", tmp_path / "d")
    root = root_args(store)
    listing = f"`python -m infra.store {' '.join(root)} list`"
    for command in (["versions", "checkpoint/nope"], ["verify", "checkpoint/nope"], ["show", MISSING],
                    ["verify", MISSING], ["delete", MISSING]):
        code, out, err = run(capsys, store_cli, *root, *command)
        assert (code, out) == (2, ""), command
        assert err.startswith("error: checkpoint/nope is not in the store") and listing in err, (command, err)
    other = f"dataset/d@{'0' * 16}"  # the artifact exists, this version does not: list its versions
    for command in (["show", other], ["verify", other], ["delete", other]):
        code, out, err = run(capsys, store_cli, *root, *command)
        assert (code, out) == (2, ""), command
        assert err.startswith(f"error: {other} is not in the store")
        assert f"`python -m infra.store {' '.join(root)} versions dataset/d`" in err, err
    code, out, err = run(capsys, store_cli, *root, "list", "nokind")
    assert (code, out) == (2, "")
    assert err.startswith("error: kind 'nokind' (kinds there: dataset) is not in the store") and listing in err
    code, out, err = run(capsys, store_cli, *root, "verify", "dataset/d")  # what exists still answers
    assert (code, out.splitlines()) == (0, [f"ok       {ref}", "1 versions checked, 0 corrupt"])


def test_store_cli_bad_input_exits_2(store, capsys):
    store.write_bytes("runs/r/config.yaml", b"x")
    code, out, err = run(capsys, store_cli, *root_args(store), "show", "not-a-ref")
    assert (code, out) == (2, "") and "kind/name@version" in err


def test_sql_cli_on_a_missing_root_exits_2_naming_it(tmp_path, capsys):
    nowhere = tmp_path / "never-written"
    code, out, err = run(capsys, sql_cli.main, "--root", str(nowhere), "SELECT count(*) FROM rollouts")
    assert (code, out) == (2, "")
    assert err.startswith(f"error: there is no store at storage.root={str(nowhere)!r}") and "--root" in err, err
    assert not nowhere.exists()
    ArtifactStore(str(nowhere)).check()  # an empty store is a store: 0 rows
    code, out, err = run(capsys, sql_cli.main, "--root", str(nowhere), "--format", "csv",
                         "SELECT count(*) AS n FROM rollouts")
    assert (code, out) == (0, "n\n0\n"), err


def test_a_store_one_may_only_read_is_listed_and_verified_but_not_collected(tmp_path, capsys, monkeypatch):
    """A shared team store, a read-only mount: list/versions/show/verify read only; gc and delete need writes."""
    import os

    from infra import store as store_module

    store = ArtifactStore(str(tmp_path / "store"))
    ref = store.put_dir("dataset", "d", _one_file(tmp_path / "src"))
    real = os.access
    monkeypatch.setattr(store_module.os, "access",
                        lambda path, mode: False if mode == os.W_OK else real(path, mode))
    for argv in (["list"], ["versions", "dataset/d"], ["show", str(ref)], ["verify"]):
        code, out, err = run(capsys, store_cli, "--root", store.root, *argv)
        assert code == 0 and not err, (argv, err)
    code, _, err = run(capsys, store_cli, "--root", store.root, "gc")
    assert code == 1 and "is not writable" in err


def _one_file(folder: Path) -> Path:
    folder.mkdir()
    (folder / "a.txt").write_text("a")
    return folder
