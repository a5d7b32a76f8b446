"""Reading a version's files, always checked against its manifest (mixed into ``ArtifactStore``, infra/store.py,
whose ``fs``, ``manifest``, ``_vdir``, ``_errors`` and ``_corrupt`` it uses).

Integrity: every read of a version's files checks them against its manifest: the same file names (a listed file
missing or a file the manifest does not list is corruption; an upload's ``_heartbeat`` is no file of the version),
sizes and sha256, hashed while streaming (1 MiB at a time). A difference raises ``CorruptArtifactError`` naming
the version, each bad file with expected vs found, and the commands that check and remove it. When:
- local ``get_dir(ref)`` (the version folder itself, read in place): every call hashes every file. A cheaper rule
  (trusting an earlier check while names, sizes and mtimes are unchanged) would miss exactly what the check is
  for: bytes that change underneath the file system (a bad disk, a restored backup) or a same-size write that
  keeps the mtime. The cost is one sequential read of the version, small next to loading it.
- s3, or ``get_dir(ref, dest)``: each file is checked as it is downloaded; a copy already in ``dest`` (the cache,
  by default) is re-used only after the same check of every file (names, sizes, sha256), at the cost of a local
  ``get_dir`` and for the same reason; a damaged copy in the cache is downloaded again, with a warning naming
  what differed. The download goes into ``.<dest name>.partial-<random>`` beside ``dest`` and is renamed into
  place: ``dest`` is complete or absent. A killed download leaves that partial folder: gc removes those of the
  cache, and the next ``get_dir`` into the same ``dest`` those beside it (gc cannot know a caller's folders), each
  once untouched for ``temp_min_age_s``.
- manifests: parsed and checked field by field on every read. A version whose manifest is not JSON, misses a
  field or names another version is treated as not committed: listings skip it with a warning naming it, and a
  read by its ref raises ``CorruptArtifactError``.
- ``verify(ref)`` (CLI ``verify``) reads every byte of a version. ``put_dir`` of content that is already stored
  verifies the stored copy and replaces it if it is corrupt (writing the same content again repairs a version).
What is not guaranteed: authenticity. The checks catch accidental corruption; anyone who can write to the store
can also write a manifest that matches their files. Against that, checkpoints are loaded without unpickling
arbitrary objects (stages/model/safe_load.py): a forged checkpoint can hold wrong numbers, but cannot run code.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from infra.artifacts import MANIFEST, ArtifactRef, Manifest, copy_problems, file_problems, file_sha256, stream_sha256
from infra.store_base import HEARTBEAT, PARTIAL
from infra.store_gc import remove_stale_beside

logger = logging.getLogger("infra.store")  # the store's one logger, whichever of its files speaks


class VerifiedReads:
    """verify, get_dir (in place or into the cache) and the download behind it."""

    def verify(self, ref: ArtifactRef) -> Manifest:
        """Check the stored files of ref against its manifest (names, sizes, sha256 of every byte); -> the manifest.
        CorruptArtifactError listing each difference."""
        manifest, vdir = self.manifest(ref), self._vdir(ref)
        with self._errors(f"verifying {ref}"):
            sizes = self._file_sizes(vdir, manifest)
            problems = file_problems(manifest, sizes, lambda rel: self._sha256(f"{vdir}/{rel}"))
        if problems:
            raise self._corrupt(ref, problems)
        return manifest

    def _file_sizes(self, vdir: str, manifest: Manifest) -> dict[str, int]:
        """relpath -> size of every file under the version folder vdir, its manifest left out, and the heartbeat of
        an upload (infra/store_heartbeat.py: one of the same content may still run, or was killed) unless the
        manifest lists a file of that name (stored before the name was reserved)."""
        sizes = {path[len(vdir) + 1:]: info["size"] for path, info in self.fs.find(vdir, detail=True).items()}
        sizes.pop(MANIFEST, None)
        if HEARTBEAT not in manifest.files:
            sizes.pop(HEARTBEAT, None)
        return sizes

    def _sha256(self, path: str) -> str:
        with self.fs.open(path, "rb") as f:
            return stream_sha256(f)

    def get_dir(self, ref: ArtifactRef, dest: str | Path | None = None) -> Path:
        """A local folder with the files of ref (plus _manifest.json), checked against the manifest
        (CorruptArtifactError if they differ; see the module docstring).

        Local store and no dest: the version folder itself (read-only use), verified in full at every call.
        Otherwise the files are copied or downloaded into dest (default: ``cache_dir/kind/name/version``), each
        checked as it arrives; a copy already there is verified in full and re-used if intact, and replaced
        (with a warning) if it is the cache's. The files arrive in a partial folder beside dest, renamed into place
        at the end: dest is complete or absent.
        """
        if not self.is_remote and dest is None:
            self.verify(ref)
            return Path(self._vdir(ref))
        manifest = self.manifest(ref)
        cached = dest is None
        dest = Path(dest) if dest is not None else self.cache_dir / ref.kind / ref.name / ref.version
        self._remove_stale_partials(dest)
        problems = copy_problems(dest, manifest)
        if not problems:
            return dest
        if dest.exists() and any(dest.iterdir()):
            if not cached:
                raise ValueError(f"dest={str(dest)!r} exists and is not a complete copy of {ref} "
                                 f"({'; '.join(problems)}); pass an empty or new folder")
            logger.warning("the cached copy %s of %s is incomplete or damaged (%s); downloading it again", dest, ref,
                           "; ".join(problems))
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}{PARTIAL}"))
        try:
            self._download(manifest, partial)
            if dest.exists():
                dest.rmdir()  # empty, checked above
            os.rename(partial, dest)
        except BaseException as exc:
            shutil.rmtree(partial, ignore_errors=True)
            if not (isinstance(exc, OSError) and not copy_problems(dest, manifest)):  # else: a concurrent
                raise  # reader finished the same copy first
        return dest

    def _remove_stale_partials(self, dest: Path) -> None:
        """Remove the partial downloads into dest that killed processes left beside it, once untouched for
        temp_min_age_s (as gc does in the cache; a live download writes as the bytes arrive)."""
        remove_stale_beside(dest.parent, f".{dest.name}{PARTIAL}", self.temp_min_age_s)

    def _download(self, manifest: Manifest, target: Path) -> None:
        """Copy the version's files into target, checking names, sizes and sha256 against the manifest."""
        vdir = self._vdir(manifest.ref)

        def fetch(rel: str) -> str:  # one file of the right size: download it, -> the sha256 of the copy
            local = target / rel
            local.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(f"{vdir}/{rel}", str(local))
            return file_sha256(local)

        with self._errors(f"downloading {manifest.ref}"):
            problems = file_problems(manifest, self._file_sizes(vdir, manifest), fetch)
        if problems:
            raise self._corrupt(manifest.ref, problems)
        # each file was hashed as it arrived; the folder itself may have lost some since (`gc --now` removes partial
        # downloads, and fetch would recreate the folder for the files after): names and sizes once more
        arrived = {p.relative_to(target).as_posix(): p.stat().st_size for p in target.rglob("*") if p.is_file()}
        lost = file_problems(manifest, arrived, lambda rel: manifest.files[rel]["sha256"])
        if lost:
            raise RuntimeError(f"the download of {manifest.ref} into {target} lost files while it ran "
                               f"({'; '.join(lost)}): was the partial folder removed (gc --now)? Run it again")
        (target / MANIFEST).write_bytes(manifest.to_json())
