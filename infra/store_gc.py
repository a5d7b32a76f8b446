"""Garbage collection of the artifact store (mixed into ``ArtifactStore``, infra/store.py): what crashed writes
leave behind, and versions whose manifest is corrupt. ``GcReport`` says what each kind is and when it goes.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from infra.artifacts import MANIFEST, ArtifactRef
from infra.s3 import stall_bound_s
from infra.store_base import ARTIFACTS, PARTIAL, STAGING, CorruptArtifactError
from infra.store_tables import is_temp_name

logger = logging.getLogger("infra.store")  # the store's one logger, whichever of its files speaks

GC_MIN_AGE_S = 3600.0


@dataclass(frozen=True)
class GcReport:
    """What one gc found and removed.

    leftovers: staging folders and version folders without a manifest (crashed artifact writes), removed.
    temp_files: removed temp files of table writes (``.<name>.<random>.tmp`` beside the file, local roots) and partial
      downloads into the cache (``.<version>.partial-<random>/``) untouched (newest mtime in them) for
      ``temp_min_age_s``: GC_MIN_AGE_S = 1 h, or twice the longest one S3 request can go silent (`stall_bound_s`)
      if that is longer. A live write renames its temp file right after writing it, and a download writes as the
      bytes arrive or fails within `stall_bound_s`; a process silent for an hour also lost its stage lease 30 times
      over (lease.TTL_S = 120 s). So only the temp files of killed processes are that old.
    num_fresh_temp: younger ones, kept (they may belong to a write in progress).
    corrupt: versions whose manifest exists but is not valid. Readers skip them, so checkpoint pruning never
      removes them; they are removed only when asked (corrupt_removed), since their files may still be worth
      saving by hand. A version being written has no manifest yet: it is never among them.
    """

    leftovers: list[str]
    temp_files: list[str]
    num_fresh_temp: int
    corrupt: list[ArtifactRef]
    corrupt_removed: bool

    @property
    def num_removed(self) -> int:
        return len(self.leftovers) + len(self.temp_files) + (len(self.corrupt) if self.corrupt_removed else 0)


def _last_touched(path: Path) -> float:
    """The newest mtime of path and everything under it; now if it vanishes meanwhile (its writer just finished)."""
    try:
        times = [path.lstat().st_mtime]
        for folder, subfolders, files in os.walk(path):
            times += [Path(folder, name).lstat().st_mtime for name in subfolders + files]
    except FileNotFoundError:
        return time.time()
    return max(times)


class GarbageCollection:
    """gc and sweep of ArtifactStore."""

    @property
    def temp_min_age_s(self) -> float:
        """How long gc leaves a temp file or partial download untouched before removing it (see GcReport)."""
        return max(GC_MIN_AGE_S, 2 * stall_bound_s(self.limits))

    def gc(self, *, remove_corrupt: bool = False) -> int:
        """Remove what crashed writes left (see `sweep`); -> how many paths were removed."""
        return self.sweep(remove_corrupt=remove_corrupt).num_removed

    def sweep(self, *, remove_corrupt: bool = False) -> GcReport:
        """Remove leftovers of crashed writes and stale temp files; find versions with a corrupt manifest and remove
        them only if remove_corrupt. -> what was found and removed (GcReport says what each kind is and when it goes).

        Only run it when no artifact write is in progress: a staging folder or an upload in flight looks exactly like
        a crashed one. Temp files and partial downloads are safe at any time (they go only once stale).
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
            corrupt = self._corrupt_manifests(sorted(committed))
            for ref in corrupt if remove_corrupt else []:
                logger.warning("gc: removing %s (its manifest is corrupt)", ref)
                self.delete(ref)
        temp_files, num_fresh = self._remove_stale_temp()
        return GcReport(leftovers, temp_files, num_fresh, corrupt, remove_corrupt)

    def _corrupt_manifests(self, vdirs: list[str]) -> list[ArtifactRef]:
        """The versions among vdirs (folders holding a manifest) whose manifest is not a valid one of them."""
        found = self.fs.cat([f"{d}/{MANIFEST}" for d in vdirs], on_error="return") if vdirs else {}
        corrupt = []
        for path, data in sorted(found.items()):
            if isinstance(data, FileNotFoundError):
                continue  # deleted meanwhile
            if isinstance(data, BaseException):
                raise data  # _errors reports a connection failure
            try:
                ref = ArtifactRef(*path.rsplit("/", 4)[1:4])
            except ValueError:
                continue  # not a version folder: manifest_refs() warns about it
            try:
                self._parse_manifest(data, ref)
            except CorruptArtifactError:
                corrupt.append(ref)
        return corrupt

    def _remove_stale_temp(self) -> tuple[list[str], int]:
        """Remove the temp files of table writes (local roots) and the partial downloads in the cache untouched for
        temp_min_age_s; -> (removed paths, how many younger ones were kept)."""
        cutoff = time.time() - self.temp_min_age_s
        found = [*self.cache_dir.glob(f"*/*/.*{PARTIAL}*")]
        if not self.is_remote and os.path.isdir(self._base):
            for folder, subfolders, files in os.walk(self._base):
                if folder == self._base:  # artifacts/ and .staging/ hold files of versions, named as their owner chose
                    subfolders[:] = [d for d in subfolders if d not in (ARTIFACTS, STAGING)]
                found += [Path(folder, f) for f in files if is_temp_name(f)]
        removed = []
        for path in found:
            if _last_touched(path) < cutoff:
                logger.info("gc: removing %s (untouched for over %.0f s)", path, self.temp_min_age_s)
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                if not path.exists():  # rmtree ignored its errors: report what is really gone
                    removed.append(str(path))
        return removed, len(found) - len(removed)
