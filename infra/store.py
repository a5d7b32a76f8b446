"""Artifact store: versioned, content-addressed folders (datasets, models, checkpoints, reports, eval results)
plus a few mutable tables, on a local folder or S3 through fsspec/s3fs.

Layout under ``root`` (a local folder, ``file://``, ``memory://`` or ``s3://bucket/prefix``)::

    artifacts/{kind}/{name}/{version}/<files...>     immutable; version = content hash
    artifacts/{kind}/{name}/{version}/_manifest.json written LAST: the commit marker
    .staging/{uuid}/                                  local only: a write in progress
    <anything else>                                   mutable tables (write_bytes/read_bytes/glob)

``version`` is a content hash (infra/artifacts.py: refs, manifests, hashing, lineage), so putting the same
content twice returns the existing ref and writes nothing. Empty folders are not kept.

Guarantees (the README's "What the store guarantees" says the same to users):

Atomicity: readers (``exists``, ``manifest``, ``versions``, ``latest``, ``get_dir``) only see versions whose
manifest exists and is valid.
- local: files and manifest are copied into ``.staging/{uuid}/`` and the folder is renamed to its final
  place with one ``os.rename`` (same file system, atomic). A crash leaves only a staging folder.
- remote (s3): files are uploaded to the final prefix, the manifest last (one PUT is atomic). A failed upload raises
  ``StoreError`` and stays invisible; its files are left (writers of the same content share the prefix, so removing
  them could delete a live one's), and a retry of the same content overwrites and commits them. If a valid manifest
  of the version exists after the failure (another writer stored the same content meanwhile), the version is
  complete: it is kept and the put succeeds, as on a local store. ``gc()`` removes staging and manifest-less version
  folders untouched (newest mtime) for an hour: safe while flows write, however large their files (a local copy
  moves the mtime as it writes, an upload rewrites a heartbeat: infra/store_heartbeat.py); ``gc(now=True)`` at once,
  when nothing writes.
- ``write_bytes``: local = temp file in the same folder + ``os.replace``; s3 = one PUT. ``gc()`` removes a temp file
  (or a partial download into the cache) left by a killed process once it is untouched for an hour (GcReport).

Integrity: every read of a version's files is checked against its manifest (infra/store_reads.py: when and how).

Repair: ``verify`` reports each corrupt version, ``delete`` removes one (a damaged manifest too), ``gc`` removes
leftovers of crashed writes and lists the versions whose manifest is corrupt (no reader sees them, so checkpoint
pruning never removes them either); ``gc(remove_corrupt=True)`` (CLI ``gc --corrupt``) removes those too. A version
whose files are damaged under a valid manifest stays until ``delete``. A resume skips corrupt checkpoints by itself
(infra/checkpoints.py).

S3 credentials come only from the environment (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``); the
endpoint is ``endpoint_url`` or ``AWS_ENDPOINT_URL``. Every S3 request has a timeout and a bounded number of
attempts (``storage.timeout_s``, ``storage.max_attempts``, ``storage.min_upload_mib_s``; infra/s3.py says where
the time goes): a refused connection fails in seconds, an endpoint that accepts connections but never answers
within ``infra.s3.stall_bound_s`` (18 s with the defaults, 42 s for a 16 MiB upload), each time with a
``StoreError`` naming the operation, ``storage.root``, ``storage.endpoint_url``, the time waited and the fix.

Modules: this one holds the class, its commits and listings; infra/store_base.py the errors and reserved names,
infra/store_reads.py the checked reads and the download cache, infra/store_tables.py the mutable tables,
infra/store_gc.py garbage collection, infra/store_heartbeat.py an upload's heartbeat, infra/store_cli.py the CLI.

CLI: ``python -m infra.store [--root R] [--endpoint-url U] list [KIND] | versions KIND/NAME |
show KIND/NAME@VERSION | verify [KIND/NAME[@VERSION]] | delete KIND/NAME@VERSION | gc [--corrupt]``.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import fsspec
from botocore.exceptions import NoCredentialsError
from fsspec.asyn import sync

from infra.artifacts import MANIFEST, ArtifactRef, Manifest, hash_dir
from infra.config import ConfigError
from infra.config_sections import StorageConfig, endpoint_url_problem, glob_problem
from infra.s3 import s3_filesystem, stall_bound_s
from infra.store_base import ARTIFACTS, CONNECTION_ERRORS, STAGING, TIMEOUTS, CorruptArtifactError, StoreError
from infra.store_gc import GC_MIN_AGE_S, GarbageCollection, GcReport
from infra.store_heartbeat import check_sources, heartbeat
from infra.store_reads import VerifiedReads
from infra.store_tables import TableFiles

logger = logging.getLogger(__name__)

# Imported from here by the rest of the project (the store's public names, wherever they are defined).
__all__ = ["ArtifactStore", "CorruptArtifactError", "GC_MIN_AGE_S", "GcReport", "StoreError"]


def _local_root(root: str) -> str:
    """The absolute path of a local root; ConfigError (a ValueError) naming storage.root for a ~user that does not
    exist (expanduser's RuntimeError names neither)."""
    path = Path(root.removeprefix("file://"))
    try:
        return path.expanduser().resolve().as_posix()
    except RuntimeError:
        user = path.parts[0][1:]
        why = f"there is no user {user!r} on this machine" if user else "this process has no home folder (no HOME)"
        raise ConfigError(f"storage.root={root!r}: {why}, so {path.parts[0]!r} names no folder. Fix: write the "
                          "path out in full" + (", or use ~/... for your own home" if user else "")) from None


class ArtifactStore(VerifiedReads, TableFiles, GarbageCollection):
    """Versioned artifacts and mutable tables under one root; see the module docstring."""

    def __init__(self, root: str, endpoint_url: str | None = None, cache_dir: str | Path | None = None,
                 limits: StorageConfig | None = None):
        """limits: the S3 timeout_s, max_attempts and min_upload_mib_s of a StorageConfig (None: its defaults)."""
        self.root = root
        self.limits = limits or StorageConfig()
        self.is_remote = "://" in root and not root.startswith("file://")
        self.endpoint_url = endpoint_url or (os.environ.get("AWS_ENDPOINT_URL") if root.startswith("s3://") else None)
        self.cache_dir = Path(cache_dir or Path.home() / ".cache" / "rlpipe" / "artifacts").expanduser()
        if self.endpoint_url and (problem := endpoint_url_problem(self.endpoint_url)):
            raise ConfigError(f"endpoint_url={self.endpoint_url!r} (storage.endpoint_url, --endpoint-url or "
                              f"AWS_ENDPOINT_URL): {problem}")
        if root.startswith("s3://"):
            self.fs = s3_filesystem(self.endpoint_url, self.limits)
            self._base = root[len("s3://"):].strip("/")
        elif self.is_remote:
            self.fs = fsspec.filesystem(root.split("://")[0])
            self._base = self.fs._strip_protocol(root).rstrip("/")
        else:
            self.fs = fsspec.filesystem("file")
            self._base = _local_root(root)
        if problem := glob_problem(self._base):
            raise ConfigError(f"storage.root={root!r} (resolved: {self._base!r}): {problem}")

    @property
    def identity(self) -> tuple[str, ...]:
        """The store as resolved (for cache keys): a local root as an absolute path, a URL as given, plus the S3
        endpoint when one is set (the same bucket name on two servers is two stores)."""
        root = self.root.rstrip("/") if self.is_remote else self._base
        return (root, self.endpoint_url) if self.endpoint_url else (root,)

    @classmethod
    def from_config(cls, cfg) -> ArtifactStore:
        """Build from ``infra.config_sections.StorageConfig``."""
        return cls(cfg.root, cfg.endpoint_url, limits=cfg)

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
        """Turn connection failures and timeouts into one StoreError (see _network_error)."""
        start = time.monotonic()
        try:
            yield
        except CONNECTION_ERRORS as exc:
            raise self._network_error(action, exc, time.monotonic() - start) from exc

    def _network_error(self, action: str, exc: BaseException, waited_s: float, note: str = "") -> StoreError:
        """A StoreError naming the operation, the root, the endpoint, the time waited and the fix."""
        limits = self.limits
        if isinstance(exc, NoCredentialsError):
            fix = "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the environment"
        elif isinstance(exc, TIMEOUTS):
            fix = (f"the endpoint did not answer in {limits.max_attempts} attempts of storage.timeout_s="
                   f"{limits.timeout_s:g} s ({stall_bound_s(limits):.0f} s at most without upload): check that the "
                   "S3 server is up and not overloaded and that nothing on the way holds connections open; on a slow "
                   "link raise "
                   f"storage.timeout_s or lower storage.min_upload_mib_s={limits.min_upload_mib_s:g}")
        else:
            fix = "start the storage server or correct storage.endpoint_url/storage.root"
        return StoreError(f"{action} at {self._where()} failed after {waited_s:.1f} s: {exc}{note}. Fix: {fix}")

    def _ls_dirs(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/") for e in entries if e["type"] == "directory")

    def _committed_dirs(self, kind: str = "*", name: str = "*") -> list[str]:
        """Version folders holding a manifest file (valid or not)."""
        return [p.rsplit("/", 1)[0] for p in self.fs.glob(self._path(ARTIFACTS, kind, name, "*", MANIFEST))]

    def cli_command(self, *args: str) -> str:
        """`python -m infra.store` with this store's --root (and --endpoint-url) and args, quoted for a message."""
        endpoint = f" --endpoint-url {self.endpoint_url}" if self.endpoint_url else ""
        return f"`python -m infra.store --root {self.root}{endpoint} {' '.join(args)}`"

    def not_found(self, what: str, *listing: str) -> FileNotFoundError:
        """`what` is not in the store; the message gives the CLI command (`listing`'s arguments) that lists what is."""
        return FileNotFoundError(f"{what} is not in the store at {self._where()}; list what is with "
                                 f"{self.cli_command(*listing)}")

    def _corrupt(self, ref: ArtifactRef, problems: list[str]) -> CorruptArtifactError:
        return CorruptArtifactError(
            f"{ref} at {self._where()} is corrupt: {'; '.join(problems)}. Check it with "
            f"{self.cli_command('verify', str(ref))}, remove it with {self.cli_command('delete', str(ref))}, then "
            "re-create it (re-run the stage that made it)")

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
                except CONNECTION_ERRORS:
                    raise  # botocore's timeouts are OSErrors too: not a bucket problem, _errors reports them
                except OSError as exc:
                    raise StoreError(f"bucket {bucket!r} of {self._where()} is not usable ({exc!r}): create it "
                                     "or fix storage.root / the AWS_* credentials") from exc

    def check_exists(self) -> None:
        """For tools that only look (the CLIs), which must not create a store by looking: FileNotFoundError naming
        storage.root when nothing was ever stored there (local: no such folder; S3: no bucket, or no object under
        the prefix), StoreError when the storage cannot be reached."""
        with self._errors("looking for the store"):
            found = self.fs.exists(self._base) if self.is_remote else Path(self._base).is_dir()
            bucket = self._base.split("/")[0]
            no_bucket = not found and self.root.startswith("s3://") and not self.fs.exists(bucket)
        if not found:
            why = (f"there is no bucket {bucket!r}" if no_bucket else "nothing is stored under that prefix"
                   ) if self.is_remote else "no such folder"
            raise FileNotFoundError(f"there is no store at {self._where()}: {why}. Fix: pass --root the store the "
                                    "pipeline wrote to (its storage.root; default outputs/store), "
                                    "`python -m infra.store --root ROOT list` lists what a store holds")

    def exists(self, ref: ArtifactRef) -> bool:
        """True if this version is committed: its manifest exists and is valid."""
        try:
            self.manifest(ref)
        except (FileNotFoundError, CorruptArtifactError):
            return False
        return True

    def manifest(self, ref: ArtifactRef) -> Manifest:
        """The manifest of a committed version; FileNotFoundError naming the ref if there is none,
        CorruptArtifactError if it is not a valid manifest of this version."""
        path = f"{self._vdir(ref)}/{MANIFEST}"
        with self._errors(f"reading {ref}"):
            try:
                data = self.fs.cat_file(path)
            except FileNotFoundError:
                raise self.not_found(str(ref), "versions", f"{ref.kind}/{ref.name}") from None
        return self._parse_manifest(data, ref)

    def _parse_manifest(self, data: bytes, ref: ArtifactRef) -> Manifest:
        try:
            manifest = Manifest.from_json(data, MANIFEST)
        except ValueError as exc:
            raise self._corrupt(ref, [str(exc)]) from exc
        if manifest.ref != ref:  # copied into another version's folder
            raise self._corrupt(ref, [f"{MANIFEST} describes {manifest.ref}"])
        return manifest

    def put_dir(self, kind: str, name: str, local_dir: str | Path, *, inputs: dict | None = None,
                config_hash: str = "", metadata: dict | None = None) -> ArtifactRef:
        """Store every file under local_dir as kind/name@<content hash>; idempotent for the same content (an
        intact stored copy is kept, a corrupt one replaced)."""
        version, files, sources = hash_dir(Path(local_dir))
        check_sources(sources)
        ref = ArtifactRef(kind, name, version)
        try:
            self.verify(ref)  # the same content again is also how a corrupt version gets repaired
        except FileNotFoundError:
            pass
        except CorruptArtifactError as exc:
            logger.warning("replacing %s: %s", ref, exc)
            self.delete(ref)
        else:
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

    def _remove(self, paths: list[str], action: str, recursive: bool = False) -> None:
        """Remove files (or folders, `recursive`) by full path, missing ones aside. On S3 through DeleteObjects with
        its answer read: the server answers each key on its own, and s3fs drops a key's error, so a refused removal
        passed as done (an abandoned attempt's rows stayed visible, gc reported removals that never happened)."""
        with self._errors(action):
            if not self.is_remote:
                for path in paths:
                    try:
                        self.fs.rm(path, recursive=recursive)
                    except FileNotFoundError:
                        pass
                return
            keys = [key for path in paths for key in (self.fs.find(path) if recursive else [path])]
            refused = []
            for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
                bucket = self.fs.split_path(keys[i])[0]
                objects = [{"Key": self.fs.split_path(key)[1]} for key in keys[i:i + 1000]]
                answer = sync(self.fs.loop, self.fs._call_s3, "delete_objects", Bucket=bucket,
                              Delete={"Objects": objects, "Quiet": True})
                refused += answer.get("Errors", [])
            self.fs.invalidate_cache()
        if refused:
            first = refused[0]
            raise StoreError(f"{action} at {self._where()}: the storage refused to remove {len(refused)} of "
                             f"{len(keys)} files ({first.get('Key')}: {first.get('Code')} {first.get('Message')}). "
                             "Fix: check that these credentials may delete objects there (and that no object lock "
                             "holds them), then rerun")

    def _discard(self, path: str) -> None:
        """Best-effort removal of a failed write; gc() removes what is left."""
        try:
            self.fs.rm(path, recursive=True)
        except (*CONNECTION_ERRORS, OSError) as exc:
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
        vdir, start = self._vdir(ref), time.monotonic()
        try:
            with heartbeat(self.fs, vdir, self.temp_min_age_s):  # gc sees the upload alive while a big file goes
                for rel, src in sources.items():
                    self._write_file(src, f"{vdir}/{rel}")
                self._check_sent(ref, vdir, manifest)
                self.fs.pipe_file(f"{vdir}/{MANIFEST}", manifest.to_json())
        except (*CONNECTION_ERRORS, OSError) as exc:
            waited_s = time.monotonic() - start
            # a storage that does not answer would hold the check as long again
            if not isinstance(exc, TIMEOUTS) and self._committed_meanwhile(ref):
                logger.warning("the upload of %s failed (%s), but the version is committed with a valid manifest "
                               "(another writer stored the same content meanwhile): keeping it", ref, exc)
                return
            raise self._network_error(f"upload of {ref}", exc, waited_s, "; no version was committed (files already "
                                      "sent stay invisible: a re-run overwrites them, gc() removes them)") from exc

    def _check_sent(self, ref: ArtifactRef, vdir: str, manifest: Manifest) -> None:
        """Before the manifest commits the version: every file it lists is there with its size. Uploads of the same
        content share a prefix, and gc removes an abandoned one's files; one that ran while this upload started would
        have left a committed version with files missing (a StoreError now, the version uncommitted: a rerun
        uploads again)."""
        self.fs.invalidate_cache(vdir)
        sizes = self._file_sizes(vdir, manifest)
        missing = [rel for rel, meta in manifest.files.items() if sizes.get(rel) != meta["size"]]
        if missing:
            more = ", ..." if len(missing) > 1 else ""
            raise StoreError(f"upload of {ref} at {self._where()}: {len(missing)} of its {len(manifest.files)} files "
                             f"were gone or changed before its commit ({missing[0]}{more}): another process removed "
                             "them (gc of an abandoned upload of the same content, while this one started); no version "
                             "was committed. Fix: rerun")

    def _committed_meanwhile(self, ref: ArtifactRef) -> bool:
        """After a failed upload: whether ref has a valid manifest now (False if the store could not be asked).

        Uploads of the same content go to the same prefix, so a concurrent writer may have committed the version
        while this one failed. The failed upload's files are never removed: they may be a live writer's, which would
        then commit a manifest over missing files; the next put of the same content overwrites them, or gc takes
        them once no heartbeat has touched the prefix for its age."""
        try:
            return self.exists(ref)
        except (StoreError, OSError) as exc:
            logger.warning("could not check whether %s was committed meanwhile (%s)", ref, exc)
            return False

    def versions(self, kind: str, name: str) -> list[Manifest]:
        """Committed versions of kind/name, oldest first (by created)."""
        with self._errors(f"listing {kind}/{name}"):
            paths = [f"{d}/{MANIFEST}" for d in self._ls_dirs(self._path(ARTIFACTS, kind, name))]
            found = self.fs.cat(paths, on_error="return") if paths else {}
            failed = [data for data in found.values()
                      if isinstance(data, BaseException) and not isinstance(data, FileNotFoundError)]
            if failed:  # cat returns errors as values: raised here, _errors reports a timeout like any other
                raise failed[0]
        manifests = []
        for path, data in sorted(found.items()):
            if isinstance(data, FileNotFoundError):
                continue  # not committed (yet): invisible by design
            try:
                manifests.append(self._parse_manifest(data, ArtifactRef(kind, name, path.rsplit("/", 2)[-2])))
            except (ValueError, CorruptArtifactError) as exc:  # ValueError: a folder name that is no version
                logger.warning("skipping %s (treated as not committed): %s", path.rsplit("/", 1)[0], exc)
        return sorted(manifests, key=lambda m: (m.created, m.version))

    def latest(self, kind: str, name: str) -> ArtifactRef | None:
        """The newest committed version of kind/name, or None."""
        found = self.versions(kind, name)
        return found[-1].ref if found else None

    def artifacts(self, kind: str | None = None) -> list[tuple[str, str]]:
        """Sorted (kind, name) pairs with at least one manifest (listed even if each is corrupt: versions() is
        empty then); the manifests are not read."""
        with self._errors("listing artifacts"):
            dirs = self._committed_dirs(kind or "*")
        return sorted({tuple(d.rsplit("/", 3)[1:3]) for d in dirs})

    def manifest_refs(self, kind: str = "*", name: str = "*") -> list[ArtifactRef]:
        """Sorted versions whose folder holds a manifest, valid or corrupt: what ``verify`` checks."""
        with self._errors("listing manifests"):
            dirs = self._committed_dirs(kind, name)
        refs = []
        for path in dirs:
            try:
                refs.append(ArtifactRef(*path.rsplit("/", 3)[1:]))
            except ValueError as exc:
                logger.warning("skipping %s: not a version folder (%s); remove it by hand", path, exc)
        return sorted(refs, key=str)

    def delete(self, ref: ArtifactRef) -> None:
        """Remove a version, committed, corrupt or half-written: manifest first (it disappears for readers at
        once), then its files."""
        vdir = self._vdir(ref)
        with self._errors(f"deleting {ref}"):
            if not self.fs.exists(vdir):
                raise self.not_found(str(ref), "versions", f"{ref.kind}/{ref.name}")
            if self.fs.exists(f"{vdir}/{MANIFEST}"):
                self._remove([f"{vdir}/{MANIFEST}"], f"deleting {ref}")
        self._remove([vdir], f"deleting {ref}", recursive=True)


if __name__ == "__main__":  # the CLI lives in infra/store_cli.py; `python -m infra.store` stays its command
    from infra.store_cli import main

    main()
