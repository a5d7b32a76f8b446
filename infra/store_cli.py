"""The store's command line, ``python -m infra.store [--root R] [--endpoint-url U] COMMAND`` (infra/store.py runs
``main``): list, versions, show (manifest and lineage), verify (every byte against the manifests), delete (one
version, corrupt or not), gc (leftovers of crashed writes and temp files untouched for an hour, or at once with
--now; versions with a corrupt manifest with --corrupt). See infra/store.py for what the store guarantees.

Exit status: 0; 1 when verify finds a corrupt version or the storage fails; 2 for bad input: a root, artifact, kind
or version that is not in the store (the message names it and the command that lists what is) or a malformed name.
Looking never creates a store: a missing local root stays missing.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from infra.artifacts import ArtifactRef, describe, lineage
from infra.store import ArtifactStore, CorruptArtifactError, StoreError


def main(argv: list[str] | None = None) -> None:
    """python -m infra.store [--root R] [--endpoint-url U] list [KIND] | versions K/N | show K/N@V |
    verify [K/N[@V]] | delete K/N@V | gc [--corrupt] [--now]"""
    from infra.config_sections import StorageConfig

    default = StorageConfig()
    parser = argparse.ArgumentParser(prog="python -m infra.store",
                                     description="Inspect and repair the artifact store.")
    parser.add_argument("--root", default=default.root, help="local folder or s3://bucket/prefix")
    parser.add_argument("--endpoint-url", default=default.endpoint_url, help="S3 endpoint (or AWS_ENDPOINT_URL)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="kind/name pairs").add_argument("kind", nargs="?")
    sub.add_parser("versions", help="committed versions of KIND/NAME").add_argument("artifact")
    sub.add_parser("show", help="manifest and lineage of KIND/NAME@VERSION").add_argument("ref")
    sub.add_parser("verify", help="check versions (all, those of KIND/NAME, or one) against their manifests, every "
                   "byte; prints each corrupt one, exit status 1 if any").add_argument(
        "target", nargs="?", metavar="KIND/NAME[@VERSION]")
    sub.add_parser("delete", help="remove one version, also a corrupt one (how to repair what verify reports)"
                   ).add_argument("ref", metavar="KIND/NAME@VERSION")
    gc = sub.add_parser("gc", help="remove leftovers of crashed writes (staging and manifest-less version folders), "
                        "temp files and partial downloads, each once untouched for an hour (safe while flows write); "
                        "list versions with a corrupt manifest")
    gc.add_argument("--corrupt", action="store_true", help="also remove the versions with a corrupt manifest (no "
                    "reader loads them, but their files may be worth saving by hand first)")
    gc.add_argument("--now", action="store_true", help="remove those leftovers whatever their age: only while no flow "
                    "or other process writes to the store (a write in progress looks the same)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")  # skipped versions are named
    try:
        _run(ArtifactStore(args.root, args.endpoint_url), args)
    except (FileNotFoundError, ValueError) as exc:  # bad input (no such store, artifact or version; a bad name)
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None  # argparse's status for bad input
    except StoreError as exc:
        raise SystemExit(f"error: {exc}") from None


def _run(store: ArtifactStore, args: argparse.Namespace) -> None:
    store.check_exists()  # first: check() creates a missing local root
    if args.command in ("delete", "gc"):  # only these write: a store one may only read can be listed and verified
        store.check()
    if args.command == "list":
        _list(store, args.kind)
    elif args.command == "versions":
        kind, name = _kind_name(args.artifact)
        _require(store, kind, name)
        for m in store.versions(kind, name):
            print(describe(m))
    elif args.command == "show":
        ref = ArtifactRef.parse(args.ref)
        with _named(store, ref):
            print(store.manifest(ref).to_json().decode())
        print("lineage:\n" + "\n".join(lineage(store, str(ref), 1, set())))
    elif args.command == "verify":
        if _verify(store, args.target):
            raise SystemExit(1)
    elif args.command == "delete":
        ref = ArtifactRef.parse(args.ref)
        with _named(store, ref):
            store.delete(ref)
        print(f"deleted {args.ref}")
    else:
        _gc(store, args.corrupt, args.now)


def _list(store: ArtifactStore, kind: str | None) -> None:
    found = store.artifacts(kind)
    if kind and not found:
        kinds = ", ".join(sorted({k for k, _ in store.artifacts()})) or "none"
        raise store.not_found(f"kind {kind!r} (kinds there: {kinds})", "list")
    for kind, name in found:
        versions = store.versions(kind, name)
        if versions:  # else every manifest of kind/name is corrupt; versions() warned about each
            print(f"{kind}/{name}  versions={len(versions)}  latest={versions[-1].ref}")


def _gc(store: ArtifactStore, remove_corrupt: bool, now: bool) -> None:
    report = store.sweep(remove_corrupt=remove_corrupt, now=now)
    age = f"untouched for over {report.min_age_s:.0f} s"
    print(f"removed {len(report.leftovers)} leftovers of crashed artifact writes (staging and manifest-less version "
          f"folders) {age} (kept {report.num_fresh_leftovers} younger ones: a write may be running)")
    print(f"removed {len(report.temp_files)} temp files and partial downloads {age} "
          f"(kept {report.num_fresh_temp} younger ones: a write may be running)")
    corrupt = ", ".join(map(str, report.corrupt))
    if not report.corrupt:
        print("0 versions with a corrupt manifest")
    elif report.corrupt_removed:
        print(f"removed {len(report.corrupt)} versions with a corrupt manifest: {corrupt}")
    else:
        print(f"kept {len(report.corrupt)} versions with a corrupt manifest: {corrupt} (no reader loads them; "
              f"remove them with {store.cli_command('gc', '--corrupt')})")


def _kind_name(text: str) -> tuple[str, str]:
    kind, _, name = text.partition("/")
    if not kind or not name or "@" in name:
        raise ValueError(f"{text!r}: expected KIND/NAME, e.g. dataset/synthetic")
    return kind, name


def _require(store: ArtifactStore, kind: str, name: str) -> None:
    """FileNotFoundError, saying how to list what is there, unless kind/name has a version (a manifest)."""
    if (kind, name) not in store.artifacts(kind):
        raise store.not_found(f"{kind}/{name}", "list")


@contextmanager
def _named(store: ArtifactStore, ref: ArtifactRef) -> Iterator[None]:
    """A version that is not there: say so for its artifact when that is missing too (`list` shows what is)."""
    try:
        yield
    except FileNotFoundError:
        _require(store, ref.kind, ref.name)
        raise


def _verify(store: ArtifactStore, target: str | None) -> int:
    """Verify every version `target` names (None: the whole store), a line each; -> the number of corrupt ones."""
    if target is None:
        refs = store.manifest_refs()
    elif "@" in target:
        ref = ArtifactRef.parse(target)
        refs = [ref]
        if ref not in store.manifest_refs(ref.kind, ref.name):  # a corrupt manifest is there: verify says so
            _require(store, ref.kind, ref.name)
            raise store.not_found(target, "versions", f"{ref.kind}/{ref.name}")
    else:
        _require(store, *_kind_name(target))
        refs = store.manifest_refs(*_kind_name(target))
    num_corrupt = 0
    for ref in refs:
        try:
            store.verify(ref)
            print(f"ok       {ref}")
        except CorruptArtifactError as exc:
            num_corrupt += 1
            print(f"CORRUPT  {exc}")
    print(f"{len(refs)} versions checked, {num_corrupt} corrupt")
    return num_corrupt
