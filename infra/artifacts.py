"""Versioned artifacts as data: references, manifests (contents and lineage), content hashes.

An artifact version is ``kind/name@version`` (``ArtifactRef``). ``version`` is the first 16 hex chars of
sha256 over the sorted relative paths and the bytes of each file (``hash_dir``), so the same content always
gets the same version. Its ``Manifest`` (``_manifest.json``, the commit marker) records the files with sizes
and sha256, the inputs it was made from (lineage), the config hash, the code version and free metadata.

Reading and writing versions is ``infra.store.ArtifactStore``'s work; ``lineage`` (for the store CLI) only
walks a store through its public readers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import subprocess
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infra.store import ArtifactStore

MANIFEST = "_manifest.json"
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_VERSION = re.compile(r"^[0-9a-f]{16}$")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ArtifactRef:
    """One committed version of an artifact: ``kind/name@version``."""

    kind: str
    name: str
    version: str

    def __post_init__(self) -> None:
        for fld in ("kind", "name"):
            if not _SEGMENT.match(getattr(self, fld)):
                raise ValueError(f"artifact {fld}={getattr(self, fld)!r}: use letters, digits, '.', '_', '-' "
                                 "(starting with a letter or digit), e.g. 'sft-qwen'")
        if not _VERSION.match(self.version):
            raise ValueError(f"artifact version={self.version!r}: expected 16 lowercase hex chars (a content hash)")

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}@{self.version}"

    @classmethod
    def parse(cls, text: str) -> ArtifactRef:
        """'dataset/synthetic@0123456789abcdef' -> ArtifactRef."""
        match = re.fullmatch(r"([^/@]+)/([^/@]+)@([^/@]+)", text.strip())
        if not match:
            raise ValueError(f"artifact ref {text!r}: expected 'kind/name@version', "
                             "e.g. 'dataset/synthetic@0123456789abcdef'")
        return cls(*match.groups())


@dataclass
class Manifest:
    """What a version holds and what it was made from; saved as ``_manifest.json`` next to the files."""

    kind: str
    name: str
    version: str
    inputs: dict[str, str]  # role -> str(ArtifactRef) or a plain string such as a hub id
    config_hash: str
    code_version: str  # git commit (+ "-dirty"), "unknown" outside git
    created: str  # ISO-8601 UTC
    files: dict[str, dict] = field(default_factory=dict)  # relpath -> {"size": int, "sha256": str}
    metadata: dict = field(default_factory=dict)

    @property
    def ref(self) -> ArtifactRef:
        return ArtifactRef(self.kind, self.name, self.version)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()

    @classmethod
    def new(cls, ref: ArtifactRef, files: dict[str, dict], inputs: dict | None, config_hash: str,
            metadata: dict | None) -> Manifest:
        """The manifest of a version written now by this code: inputs as strings, metadata checked to be JSON."""
        inputs = {str(role): str(value) for role, value in (inputs or {}).items()}
        try:
            json.dumps(metadata or {})
        except TypeError as exc:
            raise ValueError(f"metadata={metadata!r} is not JSON-serialisable ({exc}); pass plain values") from exc
        return cls(ref.kind, ref.name, ref.version, inputs, config_hash, code_version(),
                   datetime.now(timezone.utc).isoformat(), files, dict(metadata or {}))

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        try:
            return cls(**json.loads(data))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where} is not a valid manifest ({exc}); delete that version or run gc") from exc


@functools.cache
def code_version() -> str:
    """Git commit of the project, '+-dirty' with uncommitted changes; 'unknown' outside git. Computed once."""
    project = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(project), *args], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def hash_dir(local_dir: Path) -> tuple[str, dict[str, dict], dict[str, Path]]:
    """-> (version, files {relpath: {size, sha256}}, sources {relpath: path}) of every file under local_dir."""
    if not local_dir.is_dir():
        raise ValueError(f"local_dir={str(local_dir)!r} is not a folder; pass the folder to store")
    sources = {p.relative_to(local_dir).as_posix(): p for p in sorted(local_dir.rglob("*")) if p.is_file()}
    if not sources:
        raise ValueError(f"local_dir={str(local_dir)!r} has no files; an artifact needs at least one")
    if MANIFEST in sources:
        raise ValueError(f"local_dir={str(local_dir)!r} contains {MANIFEST}, a reserved name; rename it")
    total, files = hashlib.sha256(), {}
    for rel in sorted(sources):
        size = sources[rel].stat().st_size
        total.update(rel.encode() + b"\0" + size.to_bytes(8, "little"))
        files[rel] = {"size": size, "sha256": file_sha256(sources[rel], total)}
    return total.hexdigest()[:16], files, sources


def file_sha256(path: Path, *also) -> str:
    """sha256 of a file's bytes, which are also fed to the digests in `also`."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            for d in (digest, *also):
                d.update(chunk)
    return digest.hexdigest()


def is_complete_copy(dest: Path, manifest: Manifest) -> bool:
    """dest holds this version's files (manifest written last, sizes match)."""
    marker = dest / MANIFEST
    if not marker.is_file() or Manifest.from_json(marker.read_bytes(), str(marker)).files != manifest.files:
        return False
    return all((dest / rel).is_file() and (dest / rel).stat().st_size == info["size"]
               for rel, info in manifest.files.items())


# ------------------------------------------------------------------------------------------------------- lineage (CLI)


def lineage(store: ArtifactStore, text: str, depth: int, seen: set[str]) -> list[str]:
    """Indented lines: text, then what it was made from, recursively."""
    pad = "  " * depth
    try:
        ref = ArtifactRef.parse(text)
    except ValueError:
        return [f"{pad}{text} (external)"]
    if text in seen or not store.exists(ref):
        return [f"{pad}{text}" + ("" if text in seen else " (not in store)")]
    lines = [f"{pad}{text}"]
    for role, source in store.manifest(ref).inputs.items():
        sub = lineage(store, source, depth + 1, seen | {text})
        lines += [f"{'  ' * (depth + 1)}{role} <- {sub[0].strip()}", *sub[1:]]
    return lines


def describe(m: Manifest) -> str:
    """One version in three lines, as `python -m infra.store versions` prints it."""
    size = sum(f["size"] for f in m.files.values())
    inputs = ", ".join(f"{role}={src}" for role, src in m.inputs.items()) or "-"
    return (f"{m.ref}  created={m.created}  files={len(m.files)}  bytes={size}  code={m.code_version}\n"
            f"    inputs: {inputs}\n    metadata: {json.dumps(m.metadata, sort_keys=True)}")
