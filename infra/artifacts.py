"""Versioned artifacts as data: references, manifests (contents and lineage), content hashes.

An artifact version is ``kind/name@version`` (``ArtifactRef``). ``version`` is the first 16 hex chars of
sha256 over the sorted relative paths and the bytes of each file (``hash_dir``), so the same content always
gets the same version. Its ``Manifest`` (``_manifest.json``, the commit marker) records the files with sizes
and sha256, the inputs it was made from (lineage), the config hash, the code version and free metadata.
A manifest read back is checked field by field (``Manifest.from_json``), and ``file_problems`` compares the
files found with it (missing, unlisted, size, sha256), ``copy_problems`` those of a local copy: the store's
integrity checks.

Reading and writing versions is ``infra.store.ArtifactStore``'s work; ``lineage`` (for the store CLI) only
walks a store through its public readers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from infra.store import ArtifactStore

MANIFEST = "_manifest.json"
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_VERSION = re.compile(r"^[0-9a-f]{16}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
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
        """Parse and check a manifest; ValueError naming `where` and what is wrong (not JSON, a field missing,
        unknown or of the wrong type)."""
        try:
            manifest = cls(**json.loads(data))
            manifest._check()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where} is not a valid manifest ({exc})") from exc
        return manifest

    def _check(self) -> None:
        """Every field as Manifest.new writes it: readers index files, sizes and hashes without further checks,
        and a file path never leaves the version folder (a download writes to it)."""
        ArtifactRef(self.kind, self.name, self.version)  # raises unless kind, name and version are well-formed
        if not all(isinstance(v, str) for v in (self.config_hash, self.code_version, self.created)):
            raise TypeError("config_hash, code_version and created must be strings")
        if not isinstance(self.inputs, dict) or not all(isinstance(v, str) for v in self.inputs.values()):
            raise TypeError(f"inputs={self.inputs!r} must map roles to strings")
        if not isinstance(self.metadata, dict):
            raise TypeError(f"metadata={self.metadata!r} must be an object")
        if not isinstance(self.files, dict) or not self.files:
            raise TypeError("files must be a non-empty object")
        for rel, info in self.files.items():
            parts = rel.split("/")
            if rel == MANIFEST or rel.startswith("/") or ".." in parts or "" in parts:
                raise ValueError(f"file path {rel!r} is not a relative path inside the version")
            if (not isinstance(info, dict) or info.keys() != {"size", "sha256"} or type(info["size"]) is not int
                    or info["size"] < 0 or not _SHA256.match(str(info["sha256"]))):
                raise ValueError(f"files[{rel!r}]={info!r}: expected {{'size': int >= 0, 'sha256': 64 hex chars}}")


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
    with open(path, "rb") as f:
        return stream_sha256(f, *also)


def stream_sha256(f: BinaryIO, *also) -> str:
    """sha256 of what is left in an open binary file, read in 1 MiB chunks (also fed to the digests in `also`)."""
    digest = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        for d in (digest, *also):
            d.update(chunk)
    return digest.hexdigest()


def file_problems(manifest: Manifest, sizes: dict[str, int], sha256_of: Callable[[str], str]) -> list[str]:
    """How the files found (relpath -> size, the manifest itself left out) differ from the manifest: files
    missing, files it does not list, then per file the size or else the sha256 (`sha256_of(relpath)` is only
    called for files of the right size). Empty: the files are exactly the version's."""
    expected = manifest.files
    problems = [f"{rel}: missing (the manifest lists it)" for rel in sorted(expected.keys() - sizes.keys())]
    problems += [f"{rel}: not in the manifest (a stray file)" for rel in sorted(sizes.keys() - expected.keys())]
    for rel in sorted(expected.keys() & sizes.keys()):
        if sizes[rel] != expected[rel]["size"]:
            problems.append(f"{rel}: {sizes[rel]} bytes, expected {expected[rel]['size']}")
        elif (found := sha256_of(rel)) != expected[rel]["sha256"]:
            problems.append(f"{rel}: sha256 {found}, expected {expected[rel]['sha256']}")
    return problems


def copy_problems(dest: Path, manifest: Manifest) -> list[str]:
    """How a local copy of the version in dest differs from its manifest; empty: an intact, complete copy.

    Checked like a stored version (names, sizes, sha256 of every byte), after the copy's own manifest (written
    last, so a missing one means an unfinished copy). Hashing costs one read of the copy, as a local
    ``get_dir`` pays on every call; checking names and sizes only would hand a copy whose bytes changed in place
    (bit rot, a same-size write) to the loader without a word.
    """
    marker = dest / MANIFEST
    if not marker.is_file():
        return [f"{MANIFEST}: missing (an unfinished copy)"]
    try:
        if Manifest.from_json(marker.read_bytes(), str(marker)).files != manifest.files:
            return [f"{MANIFEST}: lists other files than the stored version's"]
    except ValueError as exc:
        return [str(exc)]
    sizes = {p.relative_to(dest).as_posix(): p.stat().st_size for p in dest.rglob("*") if p.is_file()}
    sizes.pop(MANIFEST, None)
    return file_problems(manifest, sizes, lambda rel: file_sha256(dest / rel))


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
