"""Loading checkpoints without running code: a checkpoint is data, and whoever can write to the store must not be
able to run code in the process that resumes or merges it (the store's hashes catch accidents, not forgeries).

Unpickling runs whatever an object's `__reduce__` names, so no checkpoint file is unpickled freely:
- `load_state` (trainer state, SFT train state): `torch.load(weights_only=True)`, which builds tensors and plain
  values (numbers, strings, None, lists, tuples, dicts) only. Everything we save is made of those: Python's
  random state is a tuple of ints, optimizer and LR-scheduler state dicts hold tensors and numbers (the
  scheduler's lambda is saved as None).
- DCP folders (`SafeFileSystemReader`, `SafeLoadPlanner`, `SafeEmptyStateDictLoadPlanner`): torch 2.13's
  FileSystemReader reads `.metadata` with a plain `pickle.load`, and DCP's planners read non-tensor values (optimizer
  hyper-parameters, scheduler state) from the shard files with `torch.load(weights_only=False)`; DCP offers no
  safe-globals option for either. Here `.metadata` goes through an unpickler that resolves only the classes DCP's
  `Metadata` is made of (its dataclasses, torch.Size, dtypes, layouts, paths), every shard file it names must be a
  file name inside the folder, and non-tensor values are read with `weights_only=True`.
Anything else is refused with `UnsafeCheckpointError` naming the file, before any of it is built.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds objects other than tensors and plain values; it was not loaded."""


def _refuse(where: str, reason: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{where}: refused to load: {reason}. This pipeline never saves such a file, so the checkpoint was altered "
        "by someone who could write to the store (and its manifest). Do not load it with weights_only=False: remove "
        "that version (its folder in the path is checkpoint/NAME/VERSION: `python -m infra.store delete "
        "checkpoint/NAME@VERSION`) and resume from another checkpoint or start over")


def _holds(what: str) -> str:
    return f"it holds {what}, which is neither tensor data nor a plain value (unpickling it could run code)"


def load_state(file: str | Path | BinaryIO, where: str | None = None, mmap: bool = False) -> Any:
    """torch.load(weights_only=True) on CPU; UnsafeCheckpointError naming the file and what it held if refused."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = re.search(r"WeightsUnpickler error: (.*?)(?: was not an allowed global|\n|$)", str(exc))
        raise _refuse(where or str(file), _holds(found.group(1) if found else "an object torch refuses")) from None


# ---- DCP ---------------------------------------------------------------------------------------------

_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup in torch's own table of layouts
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def load_dcp_metadata(file: BinaryIO, where: str) -> Metadata:
    """DCP's `.metadata` pickle, built from the classes of `Metadata` only; its shard files are file names."""
    try:
        metadata = _MetadataUnpickler(file).load()
    except pickle.UnpicklingError as exc:
        raise _refuse(where, _holds(f"the global {exc}")) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise _refuse(where, f"it holds a {type(metadata).__name__}, not DCP metadata with shard locations")
    for info in metadata.storage_data.values():  # read_data opens folder / relative_path
        if not isinstance(info, _StorageInfo) or Path(str(info.relative_path)).name != info.relative_path:
            raise _refuse(where, f"it names a shard location {info!r} outside the checkpoint folder")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with `.metadata` read by `load_dcp_metadata` instead of pickle.load, once, when the
    reader is made: a refusal raises there as itself (inside dcp.load, DCP would keep only its text)."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        metadata_path = self._get_metadata_path()
        with self.fs.create_stream(metadata_path, "rb") as file:
            self.metadata = load_dcp_metadata(file, str(metadata_path))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # as FileSystemReader.read_metadata does after unpickling
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


@contextmanager
def refusals_raised() -> Iterator[None]:
    """Re-raise a rank's UnsafeCheckpointError as itself: dcp.load wraps every rank's failure in one
    CheckpointException."""
    try:
        yield
    except CheckpointException as exc:
        refused = [e for e, _ in exc.failures.values() if isinstance(e, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        raise


class _SafeBytes:
    """DefaultLoadPlanner.load_bytes with weights_only=True (DCP's own unpickles anything); `folder` is named in
    the error."""

    def __init__(self, *args: Any, folder: str | Path, **kwargs: Any):
        self.folder = folder
        super().__init__(*args, **kwargs)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_state(value, where=f"{self.folder} (the value of {fqn!r})")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    pass


class SafeEmptyStateDictLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    pass
