"""Artifact store: versioned, content-addressed folders (datasets, models, checkpoints, reports, eval results)
plus a few mutable tables, on a local folder or S3 through fsspec/s3fs.

Layout under ``root`` (a local folder, ``file://``, ``memory://`` or ``s3://bucket/prefix``)::

    artifacts/{kind}/{name}/{version}/<files...>     immutable; version = content hash
    artifacts/{kind}/{name}/{version}/_manifest.json written LAST: the commit marker
    .staging/{uuid}/                                  local only: a write in progress
    <anything else>                                   mutable tables (write_bytes/read_bytes/glob)

``version`` is a content hash (infra/artifacts.py: refs, manifests, hashing, lineage), so putting the same
content twice returns the existing ref and writes nothing. Empty folders are not kept.

Atomicity: readers (``exists``, ``manifest``, ``versions``, ``latest``, ``artifacts``, ``get_dir``) only see
versions whose manifest exists.
- local: files and manifest are copied into ``.staging/{uuid}/`` and the folder is renamed to its final
  place with one ``os.rename`` (same file system, atomic). A crash leaves only a staging folder.
- remote (s3): files are uploaded to the final prefix, the manifest last (one PUT is atomic). A failed upload
  raises ``StoreError``, is cleaned up best-effort and stays invisible; a retry of the same content overwrites
  and commits it. ``gc()`` removes staging folders and manifest-less version folders; run it only when no
  write is in progress (it cannot tell a crashed write from a running one).
- ``write_bytes``: local = temp file in the same folder + ``os.replace``; s3 = one PUT.

S3 credentials come only from the environment (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``); the
endpoint is ``endpoint_url`` or ``AWS_ENDPOINT_URL``. Timeouts and retries are small so that an unreachable
endpoint fails in seconds with a ``StoreError`` naming ``storage.root`` and ``storage.endpoint_url``.

CLI: ``python -m infra.store [--root R] [--endpoint-url U] list [KIND] | versions KIND/NAME |
show KIND/NAME@VERSION | gc``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import fsspec
from botocore.exceptions import BotoCoreError, NoCredentialsError
from fsspec.exceptions import FSTimeoutError

from infra.artifacts import MANIFEST, ArtifactRef, Manifest, describe, file_sha256, hash_dir, is_complete_copy, lineage

logger = logging.getLogger(__name__)

ARTIFACTS = "artifacts"
STAGING = ".staging"
CONNECT_TIMEOUT_S = 2
READ_TIMEOUT_S = 10
MAX_ATTEMPTS = 2  # botocore attempts per request (and s3fs retries): unreachable fails in seconds
_BOTOCORE = {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S,
             "retries": {"max_attempts": MAX_ATTEMPTS, "mode": "standard"}}
_CONNECTION_ERRORS = (BotoCoreError, aiohttp.ClientError, asyncio.TimeoutError, FSTimeoutError)


class StoreError(RuntimeError):
    """Storage unreachable or a write failed; the message names the root, the endpoint and the fix."""


class ArtifactStore:
    """Versioned artifacts and mutable tables under one root; see the module docstring."""

    def __init__(self, root: str, endpoint_url: str | None = None, cache_dir: str | Path | None = None):
        self.root = root
        self.is_remote = "://" in root and not root.startswith("file://")
        self.endpoint_url = endpoint_url or (os.environ.get("AWS_ENDPOINT_URL") if root.startswith("s3://") else None)
        self.cache_dir = Path(cache_dir or Path.home() / ".cache" / "rlpipe" / "artifacts").expanduser()
        if root.startswith("s3://"):
            self.fs = fsspec.filesystem("s3", endpoint_url=self.endpoint_url, skip_instance_cache=True,
                                        use_listings_cache=False, config_kwargs=_BOTOCORE)
            self.fs.retries = MAX_ATTEMPTS  # s3fs's own retry loop on top of botocore's
            self._base = root[len("s3://"):].strip("/")
        elif self.is_remote:
            self.fs = fsspec.filesystem(root.split("://")[0])
            self._base = self.fs._strip_protocol(root).rstrip("/")
        else:
            self.fs = fsspec.filesystem("file")
            self._base = Path(root.removeprefix("file://")).expanduser().resolve().as_posix()

    @classmethod
    def from_config(cls, cfg) -> ArtifactStore:
        """Build from ``infra.config.StorageConfig``."""
        return cls(cfg.root, cfg.endpoint_url)

    def __repr__(self) -> str:
        return f"ArtifactStore(root={self.root!r}, endpoint_url={self.endpoint_url!r})"

    def _path(self, *parts: str) -> str:
        return "/".join([self._base, *parts])

    def _vdir(self, ref: ArtifactRef) -> str:
        return self._path(ARTIFACTS, ref.kind, ref.name, ref.version)

    def _where(self) -> str:
        return f"storage.root={self.root!r} (storage.endpoint_url={self.endpoint_url!r})"

    @contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        """Turn connection failures into one StoreError naming the root, the endpoint and the fix."""
        try:
            yield
        except _CONNECTION_ERRORS as exc:
            no_credentials = isinstance(exc, NoCredentialsError)
            fix = ("set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the environment" if no_credentials
                   else "start the storage server or correct storage.endpoint_url/storage.root")
            raise StoreError(f"{action} at {self._where()} failed: {exc}. Fix: {fix}") from exc

    def _ls_dirs(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/") for e in entries if e["type"] == "directory")

    def _committed_dirs(self, kind: str = "*") -> list[str]:
        return [p.rsplit("/", 1)[0] for p in self.fs.glob(self._path(ARTIFACTS, kind, "*", "*", MANIFEST))]

    def check(self) -> None:
        """Fail fast with StoreError if the root cannot be reached or written."""
        if not self.is_remote:
            try:
                Path(self._base).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot create {self._where()}: {exc}; fix storage.root") from exc
            if not os.access(self._base, os.W_OK):
                raise StoreError(f"{self._where()} is not writable; fix its permissions or storage.root")
        elif self.root.startswith("s3://"):
            bucket = self._base.split("/")[0]
            with self._errors("reaching the bucket"):
                try:
                    self.fs.call_s3("head_bucket", Bucket=bucket)
                except OSError as exc:
                    raise StoreError(f"bucket {bucket!r} of {self._where()} is not usable ({exc!r}): create it "
                                     "or fix storage.root / the AWS_* credentials") from exc

    def exists(self, ref: ArtifactRef) -> bool:
        """True if this version is committed (its manifest exists)."""
        with self._errors(f"checking {ref}"):
            return self.fs.exists(f"{self._vdir(ref)}/{MANIFEST}")

    def manifest(self, ref: ArtifactRef) -> Manifest:
        """The manifest of a committed version; FileNotFoundError naming the ref if there is none."""
        path = f"{self._vdir(ref)}/{MANIFEST}"
        with self._errors(f"reading {ref}"):
            try:
                data = self.fs.cat_file(path)
            except FileNotFoundError:
                raise FileNotFoundError(f"{ref} is not in the store at {self._where()}; list versions with "
                                        f"`python -m infra.store versions {ref.kind}/{ref.name}`") from None
        return Manifest.from_json(data, path)

    def put_dir(self, kind: str, name: str, local_dir: str | Path, *, inputs: dict | None = None,
                config_hash: str = "", metadata: dict | None = None) -> ArtifactRef:
        """Store every file under local_dir as kind/name@<content hash>; idempotent for the same content."""
        version, files, sources = hash_dir(Path(local_dir))
        ref = ArtifactRef(kind, name, version)
        if self.exists(ref):
            logger.info("%s already stored; nothing written", ref)
            return ref
        manifest = Manifest.new(ref, files, inputs, config_hash, metadata)
        (self._commit_remote if self.is_remote else self._commit_local)(ref, sources, manifest)
        logger.info("stored %s (%d files, %d bytes)", ref, len(files), sum(f["size"] for f in files.values()))
        return ref

    def _write_file(self, src: Path, dest: str) -> None:
        """Copy or upload one file (a single hook so that tests can interrupt a write)."""
        if self.is_remote:
            self.fs.put_file(str(src), dest)
        else:
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)

    def _discard(self, path: str) -> None:
        """Best-effort removal of a failed write; gc() removes what is left."""
        try:
            self.fs.rm(path, recursive=True)
        except (*_CONNECTION_ERRORS, OSError) as exc:
            logger.warning("could not clean up %s (%s); run `python -m infra.store gc` later", path, exc)

    def _commit_local(self, ref: ArtifactRef, sources: dict[str, Path], manifest: Manifest) -> None:
        staging, final = self._path(STAGING, uuid.uuid4().hex), Path(self._vdir(ref))
        try:
            for rel, src in sources.items():
                self._write_file(src, f"{staging}/{rel}")
            Path(staging, MANIFEST).write_bytes(manifest.to_json())
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists() and not (final / MANIFEST).exists():
                shutil.rmtree(final)  # leftover without a commit marker: never visible, safe to replace
            os.rename(staging, final)
        except BaseException as exc:
            self._discard(staging)
            if not (isinstance(exc, OSError) and (final / MANIFEST).exists()):  # else: a concurrent writer
                raise  # committed the same content first, which is success

    def _commit_remote(self, ref: ArtifactRef, sources: dict[str, Path], manifest: Manifest) -> None:
        vdir = self._vdir(ref)
        try:
            for rel, src in sources.items():
                self._write_file(src, f"{vdir}/{rel}")
            self.fs.pipe_file(f"{vdir}/{MANIFEST}", manifest.to_json())
        except (*_CONNECTION_ERRORS, OSError) as exc:
            self._discard(vdir)
            raise StoreError(f"upload of {ref} to {self.root} (storage.endpoint_url={self.endpoint_url!r}) failed: "
                             f"{exc!r}; no version was committed; re-run when storage is reachable") from exc

    def get_dir(self, ref: ArtifactRef, dest: str | Path | None = None) -> Path:
        """A local folder with the files of ref (plus _manifest.json).

        Local store and no dest: the version folder itself (read-only use). Otherwise the files are copied or
        downloaded into dest (default: ``cache_dir/kind/name/version``), checked against the manifest's sha256,
        and an existing complete copy is re-used.
        """
        manifest = self.manifest(ref)
        if not self.is_remote and dest is None:
            return Path(self._vdir(ref))
        dest = Path(dest) if dest is not None else self.cache_dir / ref.kind / ref.name / ref.version
        if is_complete_copy(dest, manifest):
            return dest
        if dest.exists() and any(dest.iterdir()):
            raise ValueError(f"dest={str(dest)!r} exists and is not a complete copy of {ref}; "
                             "pass an empty or new folder")
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.partial-"))
        try:
            self._download(manifest, partial)
            if dest.exists():
                dest.rmdir()  # empty, checked above
            os.rename(partial, dest)
        except BaseException as exc:
            shutil.rmtree(partial, ignore_errors=True)
            if not (isinstance(exc, OSError) and is_complete_copy(dest, manifest)):  # else: a concurrent
                raise  # reader finished the same copy first
        return dest

    def _download(self, manifest: Manifest, target: Path) -> None:
        vdir = self._vdir(manifest.ref)
        with self._errors(f"downloading {manifest.ref}"):
            for rel, info in manifest.files.items():
                local = target / rel
                local.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(f"{vdir}/{rel}", str(local))
                if file_sha256(local) != info["sha256"]:
                    raise StoreError(f"{manifest.ref}: {rel} does not match its manifest sha256 at {self._where()}; "
                                     "the stored copy is corrupt: delete that version and re-create it")
        (target / MANIFEST).write_bytes(manifest.to_json())

    def versions(self, kind: str, name: str) -> list[Manifest]:
        """Committed versions of kind/name, oldest first (by created)."""
        with self._errors(f"listing {kind}/{name}"):
            paths = [f"{d}/{MANIFEST}" for d in self._ls_dirs(self._path(ARTIFACTS, kind, name))]
            found = self.fs.cat(paths, on_error="return") if paths else {}
        manifests = []
        for path, data in sorted(found.items()):
            if isinstance(data, FileNotFoundError):
                continue  # not committed (yet): invisible by design
            if isinstance(data, BaseException):
                raise data
            manifests.append(Manifest.from_json(data, path))
        return sorted(manifests, key=lambda m: (m.created, m.version))

    def latest(self, kind: str, name: str) -> ArtifactRef | None:
        """The newest committed version of kind/name, or None."""
        found = self.versions(kind, name)
        return found[-1].ref if found else None

    def artifacts(self, kind: str | None = None) -> list[tuple[str, str]]:
        """Sorted (kind, name) pairs with at least one committed version."""
        with self._errors("listing artifacts"):
            dirs = self._committed_dirs(kind or "*")
        return sorted({tuple(d.rsplit("/", 3)[1:3]) for d in dirs})

    def delete(self, ref: ArtifactRef) -> None:
        """Remove a version: manifest first (it disappears for readers at once), then its files."""
        vdir = self._vdir(ref)
        with self._errors(f"deleting {ref}"):
            if not self.fs.exists(vdir):
                raise FileNotFoundError(f"{ref} is not in the store at {self._where()}")
            if self.fs.exists(f"{vdir}/{MANIFEST}"):
                self.fs.rm_file(f"{vdir}/{MANIFEST}")
            self.fs.rm(vdir, recursive=True)

    def gc(self) -> int:
        """Remove leftovers of crashed writes (staging folders, version folders without manifest); -> count.

        Only run it when no write is in progress: an upload in flight looks exactly like a crashed one.
        """
        with self._errors("garbage collection"):
            leftovers = self._ls_dirs(self._path(STAGING))
            committed = set(self._committed_dirs())
            for kind_dir in self._ls_dirs(self._path(ARTIFACTS)):
                for name_dir in self._ls_dirs(kind_dir):
                    leftovers += [v for v in self._ls_dirs(name_dir) if v not in committed]
            for path in leftovers:
                logger.info("gc: removing %s", path)
                self.fs.rm(path, recursive=True)
        return len(leftovers)

    def _table_path(self, relpath: str) -> str:
        parts = relpath.split("/")
        if not relpath or relpath.startswith("/") or ".." in parts or "" in parts or parts[0] in (ARTIFACTS, STAGING):
            raise ValueError(f"relpath={relpath!r}: use a relative 'a/b/file' path without '..', outside "
                             f"{ARTIFACTS}/ and {STAGING}/ (those hold immutable artifacts)")
        return self._path(relpath)

    def write_bytes(self, relpath: str, data: bytes) -> None:
        """Write one file atomically (readers see the old or the new content, never a partial file)."""
        path = self._table_path(relpath)
        if self.is_remote:
            with self._errors(f"writing {relpath}"):
                self.fs.pipe_file(path, data)
            return
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=Path(path).parent, prefix=f".{Path(path).name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def read_bytes(self, relpath: str) -> bytes:
        """The content of one table file; FileNotFoundError if missing."""
        with self._errors(f"reading {relpath}"):
            return self.fs.cat_file(self._table_path(relpath))

    def glob(self, pattern: str) -> list[str]:
        """Sorted relative paths matching pattern (e.g. 'runs/x/trajectories/*.parquet'); no temp files."""
        self._table_path(pattern)
        with self._errors(f"glob {pattern}"):
            found = self.fs.glob(self._path(pattern))
        rels = [p[len(self._base) + 1:] for p in found]
        return sorted(r for r in rels if not (r.rsplit("/", 1)[-1].startswith(".") and r.endswith(".tmp")))

    def url(self, relpath: str) -> str:
        """Full path or URL of relpath for DuckDB/pyarrow/fsspec (open it with storage_options())."""
        path = self._path(relpath)
        return self.fs.unstrip_protocol(path) if self.is_remote else path

    def storage_options(self) -> dict:
        """fsspec/pyarrow/pandas options to open url()s: the endpoint, never credentials."""
        return {"endpoint_url": self.endpoint_url} if self.endpoint_url else {}


# -------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    """python -m infra.store [--root R] [--endpoint-url U] list [KIND] | versions K/N | show K/N@V | gc"""
    from infra.config import StorageConfig

    default = StorageConfig()
    parser = argparse.ArgumentParser(prog="python -m infra.store", description="Inspect the artifact store.")
    parser.add_argument("--root", default=default.root, help="local folder or s3://bucket/prefix")
    parser.add_argument("--endpoint-url", default=default.endpoint_url, help="S3 endpoint (or AWS_ENDPOINT_URL)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="kind/name pairs").add_argument("kind", nargs="?")
    sub.add_parser("versions", help="committed versions of KIND/NAME").add_argument("artifact")
    sub.add_parser("show", help="manifest and lineage of KIND/NAME@VERSION").add_argument("ref")
    sub.add_parser("gc", help="remove leftovers of crashed writes")
    args = parser.parse_args(argv)
    try:
        _run(ArtifactStore(args.root, args.endpoint_url), args)
    except (StoreError, FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None


def _run(store: ArtifactStore, args: argparse.Namespace) -> None:
    store.check()
    if args.command == "list":
        for kind, name in store.artifacts(args.kind):
            found = store.versions(kind, name)
            print(f"{kind}/{name}  versions={len(found)}  latest={found[-1].ref}")
    elif args.command == "versions":
        kind, _, name = args.artifact.partition("/")
        if not kind or not name:
            raise ValueError(f"versions {args.artifact!r}: expected KIND/NAME, e.g. dataset/synthetic")
        for m in store.versions(kind, name):
            print(describe(m))
    elif args.command == "show":
        ref = ArtifactRef.parse(args.ref)
        print(store.manifest(ref).to_json().decode())
        print("lineage:\n" + "\n".join(lineage(store, str(ref), 1, set())))
    else:
        print(f"removed {store.gc()} leftovers")


if __name__ == "__main__":
    main()
