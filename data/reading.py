"""Reading a user's local data files: the .parquet/.jsonl files of a path, their rows with the place each came from
(for error messages that name a row and never quote it), their column names, and the rule that splits a folder's
files into training and validation by their names (data/files.py maps the rows; infra/verl_files.py checks verl's
data.train_files / val_files by the same rules).

A folder where some file names hold the word test/validation/valid/val/dev/eval keeps that split (those files are
the validation split, all others the training split).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SUFFIXES = (".parquet", ".jsonl")
VALIDATION_WORDS = {"test", "validation", "valid", "val", "dev", "eval"}


@dataclass(frozen=True)
class Location:
    """Where a row came from, for messages: `row 17 (line 18) of data.jsonl`."""

    file: str
    index: int
    line: int | None = None

    def __str__(self) -> str:
        line = f" (line {self.line})" if self.line is not None else ""
        return f"row {self.index}{line} of {self.file}"


class BadRow(ValueError):
    """A row that cannot become an Example; the message names the field and what is wrong."""


Row = tuple[Location, "dict | BadRow"]



def data_files(path: Path) -> list[Path]:
    """The .parquet/.jsonl files at `path` (a file, or a folder searched recursively), sorted."""
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use .parquet or .jsonl")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    if not files:
        raise ValueError(f"{path}: no .parquet or .jsonl files in this folder")
    return files


def read_rows(path: Path) -> Iterator[Row]:
    """Rows of one file with their locations; a JSONL line that is not UTF-8 text or not a JSON object becomes a
    BadRow (whose message never quotes the line: data may be private, and errors reach logs)."""
    if path.suffix == ".parquet":
        for i, row in enumerate(read_parquet(path).to_pylist()):
            yield Location(path.name, i), row
        return
    index = 0
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark (Notepad, Excel, PowerShell)
            row = _json_row(raw)
            if row is None:
                continue
            yield Location(path.name, index, line_no), row
            index += 1


def _json_row(raw: bytes) -> dict | BadRow | None:
    """One JSONL line -> its object, a BadRow saying what is wrong, or None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadRow(f"not UTF-8 text (byte {exc.start + 1} of the line is {raw[exc.start:exc.start + 1]!r}); "
                      "save the file as UTF-8")
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return BadRow(f"not valid JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(row, dict):
        return BadRow(f"a JSON {type(row).__name__}, expected an object with named fields")
    return row


def read_parquet(path: Path) -> pa.Table:
    with _parquet_errors(path):
        return pq.read_table(path)


@contextmanager
def _parquet_errors(path: Path) -> Iterator[None]:
    """pyarrow's errors with the file's name (its own do not say which: 'Parquet file size is 0 bytes')."""
    try:
        yield
    except (pa.ArrowInvalid, OSError) as exc:
        raise ValueError(f"{path}: not a readable parquet file ({exc}); replace or remove it") from None


def split_files(files: list[Path]) -> dict[str, list[Path]]:
    """{'train': [...], 'validation': [...]} when some files' names hold a validation word, else {'all': files}.

    A name is the file's path below the folder all the files share, without its suffix, split into words at
    non-alphanumerics: `test.jsonl`, `gsm8k_test_sample.jsonl`, `test-00000-of-00001.parquet` and
    `test/part-00000.jsonl` (beside `train/part-00000.jsonl`: its folder's name counted too) are validation files;
    every other file is a training file.
    """
    root = Path(os.path.commonpath([p.parent for p in files])) if files else Path()

    def words(path: Path) -> set[str]:
        return set(re.split(r"[^a-z0-9]+", path.relative_to(root).with_suffix("").as_posix().lower()))

    validation = [p for p in files if VALIDATION_WORDS & words(p)]
    train = [p for p in files if p not in validation]
    if not (train and validation):
        return {"all": files}
    return {"train": train, "validation": validation}


def column_names(files: list[Path]) -> set[str]:
    """Column names of the files (for JSONL: the keys of the first 1000 rows of each)."""
    names: set[str] = set()
    for path in files:
        if path.suffix == ".parquet":
            with _parquet_errors(path):
                names.update(pq.read_schema(path).names)
            continue
        for _, (_, row) in zip(range(1000), read_rows(path), strict=False):
            if isinstance(row, dict):
                names.update(row)
    return names
