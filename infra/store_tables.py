"""The store's mutable tables: single files under the root outside ``artifacts/`` and ``.staging/`` (run
configs, trajectory parquet files, reports, leases), each written atomically. Mixed into ``ArtifactStore``
(infra/store.py), whose ``fs``, ``_path`` and ``_errors`` it uses.

- ``write_bytes``: local = a temp file ``.<name>.<random>.tmp`` in the same folder, then ``os.replace``; s3 = one
  PUT. A temp file left by a killed process is removed by ``gc`` once stale (infra/store_gc.py).
- ``create_exclusive`` (for leases, infra/lease.py): local = a complete temp file hard-linked into place; S3 = a
  conditional PUT.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from infra.store_base import ARTIFACTS, STAGING

_TEMP_NAME = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")  # mkstemp(prefix=".<name>.", suffix=".tmp")


def is_temp_name(filename: str) -> bool:
    """A temp file of _temp_file (write_bytes, create_exclusive) by its name: not any dotfile ending in .tmp, which
    another tool sharing the folder may own."""
    return _TEMP_NAME.match(filename) is not None


def _temp_file(path: Path, data: bytes) -> str:
    """A complete temp file of `data` beside `path` (its parents made), with the mode a plain open() would give it:
    mkstemp makes it 0600, and the table files, reports and configs renamed from it must be as readable as the
    artifacts beside them (shared stores). Nothing is left behind when writing fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def _process_umask() -> int:
    """The umask, read at import (os.umask can only be read by setting it, which must not race other threads)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


_UMASK = _process_umask()


class TableFiles:
    """write_bytes, create_exclusive, delete_table_file(s), read_bytes, glob, url, storage_options of ArtifactStore."""

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
        tmp = _temp_file(Path(path), data)
        try:
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def create_exclusive(self, relpath: str, data: bytes) -> bool:
        """Write a new file atomically unless one exists; -> False if it existed (nothing written). For locks:
        local = a complete temp file hard-linked into place (link fails on an existing name); S3 = a conditional
        PUT (If-None-Match: *, which S3 and moto honour); other fsspec roots check first (not atomic)."""
        path = self._table_path(relpath)
        if self.root.startswith("s3://"):
            bucket, _, key = path.partition("/")
            with self._errors(f"creating {relpath}"):
                try:
                    self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
                except FileExistsError:  # s3fs's name for 412 PreconditionFailed
                    return False
            return True
        if self.is_remote:
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return True
        tmp = _temp_file(Path(path), data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            Path(tmp).unlink(missing_ok=True)

    def delete_table_file(self, relpath: str) -> None:
        self.delete_table_files([relpath])

    def delete_table_files(self, relpaths: list[str]) -> None:
        """Remove table files (missing ones are fine); a StoreError when the storage keeps any."""
        if relpaths:
            self._remove([self._table_path(rel) for rel in relpaths], f"removing {relpaths[0]}"
                         + (f" and {len(relpaths) - 1} more table files" if len(relpaths) > 1 else ""))

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
        return sorted(r for r in rels if not is_temp_name(r.rsplit("/", 1)[-1]))

    def url(self, relpath: str) -> str:
        """Full path or URL of relpath for DuckDB/pyarrow/fsspec (open it with storage_options())."""
        path = self._path(relpath)
        return self.fs.unstrip_protocol(path) if self.is_remote else path

    def storage_options(self) -> dict:
        """fsspec/pyarrow/pandas options to open url()s: the endpoint, never credentials."""
        return {"endpoint_url": self.endpoint_url} if self.endpoint_url else {}
