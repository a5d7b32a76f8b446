"""Garbage collection of the artifact store (mixed into ``ArtifactStore``, infra/store.py): what crashed writes
leave behind, and versions whose manifest is corrupt. ``GcReport`` says what each kind is and when it goes.

One rule for everything a write leaves on its way (staging and manifest-less version folders, temp files, partial
downloads): it goes once untouched (the newest mtime in it) for ``temp_min_age_s``, so gc is safe while flows write;
``sweep(now=True)`` (CLI ``gc --now``) removes it whatever its age, for when nothing writes.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime
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

    leftovers: staging folders and version folders without a manifest (crashed artifact writes) untouched (newest
      mtime of their files) for ``min_age_s``, removed. A live write is never among them, however large its files:
      a local write fills its staging folder file by file (each write moves the mtime of the file being copied) and
      renames it; an S3 upload, whose objects appear only once sent whole, rewrites a heartbeat object in its
      version folder every ``min_age_s / 6`` (at most 10 min) from the first file to the manifest
      (infra/store_heartbeat.py). A killed writer's heartbeat stops with it, so its folder goes after the age.
    num_fresh_leftovers: younger ones, kept (an artifact write in progress looks exactly the same).
    temp_files: removed temp files of table writes (``.<name>.<random>.tmp`` beside the file, local roots) and partial
      downloads into the cache (``.<version>.partial-<random>/``) untouched (newest mtime in them) for ``min_age_s``.
    num_fresh_temp: younger ones, kept (they may belong to a write in progress).
    min_age_s: ``temp_min_age_s`` (0 for ``sweep(now=True)``): GC_MIN_AGE_S = 1 h, or twice the longest one S3
      request can go silent (`stall_bound_s`) if that is longer. A live write renames its temp file right after
      writing it, writes into its staging folder as the bytes arrive or beats its upload's heartbeat (one beat is at
      most min_age_s / 6 + `stall_bound_s` old), and a download writes as the bytes arrive or fails within
      `stall_bound_s`; a process silent for an hour also lost its stage lease 30 times over (lease.TTL_S = 120 s).
      So only what killed processes left is that old.
    corrupt: versions whose manifest exists but is not valid. Readers skip them, so checkpoint pruning never
      removes them; they are removed only when asked (corrupt_removed), since their files may still be worth
      saving by hand. A version being written has no manifest yet: it is never among them.
    """

    leftovers: list[str]
    num_fresh_leftovers: int
    temp_files: list[str]
    num_fresh_temp: int
    corrupt: list[ArtifactRef]
    corrupt_removed: bool
    min_age_s: float

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


def _info_time(info: dict) -> float | None:
    """The modification time in an fsspec listing entry (s3: LastModified, local: mtime, memory: created)."""
    value = info.get("LastModified", info.get("mtime", info.get("created")))
    return value.timestamp() if isinstance(value, datetime) else value


def remove_stale(paths: list[Path], cutoff: float, min_age_s: float) -> list[str]:
    """Remove the local files and folders among paths last touched before cutoff; -> those really gone."""
    removed = []
    for path in paths:
        if _last_touched(path) < cutoff:
            logger.info("gc: removing %s (untouched for over %.0f s)", path, min_age_s)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            if not path.exists():  # rmtree ignored its errors: report what is really gone
                removed.append(str(path))
    return removed


def remove_stale_beside(parent: Path, prefix: str, min_age_s: float) -> list[str]:
    """Remove what killed writers left in parent under names starting with prefix (a partial download's, a merge's
    temporary folder), once untouched for min_age_s; -> those really gone."""
    return remove_stale(list(parent.glob(f"{glob.escape(prefix)}*")), time.time() - min_age_s, min_age_s)


class GarbageCollection:
    """gc and sweep of ArtifactStore."""

    @property
    def temp_min_age_s(self) -> float:
        """How long gc leaves what a write left untouched before removing it (see GcReport.min_age_s)."""
        return max(GC_MIN_AGE_S, 2 * stall_bound_s(self.limits))

    def gc(self, *, remove_corrupt: bool = False, now: bool = False) -> int:
        """Remove what crashed writes left (see `sweep`); -> how many paths were removed."""
        return self.sweep(remove_corrupt=remove_corrupt, now=now).num_removed

    def sweep(self, *, remove_corrupt: bool = False, now: bool = False) -> GcReport:
        """Remove leftovers of crashed writes and temp files untouched for temp_min_age_s (whatever their age if
        now); find versions with a corrupt manifest and remove them only if remove_corrupt. -> what was found and
        removed (GcReport says what each kind is and when it goes).

        Safe while flows write: what a write in progress touched within temp_min_age_s stays. now=True is for when
        nothing writes to the store (a staging folder or an upload in flight looks exactly like a crashed one).
        """
        min_age_s = 0.0 if now else self.temp_min_age_s
        cutoff = float("inf") if now else time.time() - min_age_s
        with self._errors("garbage collection"):
            committed = set(self._committed_dirs())
            found = self._uncommitted_dirs(committed)
            leftovers = [path for path in found if self._dir_touched(path) < cutoff]
            for path in leftovers:
                logger.info("gc: removing %s (a crashed artifact write, untouched for over %.0f s)", path, min_age_s)
                self._remove([path], "garbage collection", recursive=True)
            corrupt = self._corrupt_manifests(sorted(committed))
            for ref in corrupt if remove_corrupt else []:
                logger.warning("gc: removing %s (its manifest is corrupt)", ref)
                self.delete(ref)
        temp_files, num_fresh = self._remove_stale_temp(cutoff, min_age_s)
        return GcReport(leftovers, len(found) - len(leftovers), temp_files, num_fresh, corrupt, remove_corrupt,
                        min_age_s)

    def _uncommitted_dirs(self, committed: set[str]) -> list[str]:
        """Staging folders and the version folders not in committed (those holding a manifest)."""
        found = self._ls_dirs(self._path(STAGING))
        for kind_dir in self._ls_dirs(self._path(ARTIFACTS)):
            for name_dir in self._ls_dirs(kind_dir):
                found += [v for v in self._ls_dirs(name_dir) if v not in committed]
        return found

    def _dir_touched(self, path: str) -> float:
        """The newest mtime in the folder path (S3: its objects' LastModified); now if none is known."""
        if not self.is_remote:
            return _last_touched(Path(path))
        times = [_info_time(info) for info in self.fs.find(path, detail=True).values()]
        return max([t for t in times if t is not None], default=time.time())

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

    def _remove_stale_temp(self, cutoff: float, min_age_s: float) -> tuple[list[str], int]:
        """Remove the temp files of table writes (local roots) and the partial downloads in the cache last touched
        before cutoff; -> (removed paths, how many younger ones were kept)."""
        found = [*self.cache_dir.glob(f"*/*/.*{PARTIAL}*")]
        if not self.is_remote and os.path.isdir(self._base):
            for folder, subfolders, files in os.walk(self._base):
                if folder == self._base:  # artifacts/ and .staging/ hold files of versions, named as their owner chose
                    subfolders[:] = [d for d in subfolders if d not in (ARTIFACTS, STAGING)]
                found += [Path(folder, f) for f in files if is_temp_name(f)]
        removed = remove_stale(found, cutoff, min_age_s)
        return removed, len(found) - len(removed)
