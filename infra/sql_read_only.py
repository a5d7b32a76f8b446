"""What keeps SQL over the store read-only (infra/sql.py opens the connections).

Read-only: ``query``, ``read`` and the CLI run exactly one statement, a read (``READS``); anything else (COPY,
CREATE, INSERT, SET, PRAGMA settings, INSTALL/LOAD, ATTACH, ...) is a ``ReadOnlyError`` naming its type. Each
connection is also locked by DuckDB itself, set after the views and the S3 secret exist: ``allowed_paths`` = the
views' files with ``enable_external_access=false`` (no other file or URL: ``read_csv('/etc/passwd')``, ``COPY
... TO`` a new file and ``ATTACH`` of a file are refused), no extension auto-installed or auto-loaded, and
``lock_configuration`` (no SET undoes any of it).
What DuckDB's lock does not cover: it has no read-only allow-list. ``allowed_paths`` (and ``allowed_directories``)
grant every operation on a file, writing included, so on a connection whose statements are not checked
(``connect()``) ``COPY ... TO '<a view's file>' (USE_TMP_FILE false)`` overwrites that file where DuckDB reads it
itself: a local store, and S3 through httpfs (with the default ``USE_TMP_FILE`` it writes a ``tmp_`` file first,
which is refused). There, the statement check of ``query``/``read``/the CLI is what refuses writes. Roots read
through fsspec (``memory://``, S3 without httpfs) are registered read-only (``ReadOnlyFileSystem``), which refuses
every write on the connection itself. Reading local files that way too would close the gap, but costs about 10x
the time of a query (3 s instead of 0.3 s over 2,000 files: every read is a Python call under the GIL).
"""

from __future__ import annotations

import re

import duckdb
from fsspec import AbstractFileSystem

READS = ("SELECT, WITH ... SELECT, FROM ..., VALUES, TABLE, DESCRIBE, SHOW, SUMMARIZE, PIVOT/UNPIVOT ... IN (...), "
         "EXPLAIN [ANALYZE] of one of those")
# Leading comments, EXPLAIN, ANALYZE, options: what follows is the statement that EXPLAIN ANALYZE would run.
_EXPLAIN = re.compile(r"(?:\s|--[^\n]*\n|/\*.*?\*/)*EXPLAIN\s+(?:ANALY[SZ]E\s+)?"
                      r"(?:\((?![\s(]*(?:SELECT|WITH|FROM|VALUES|TABLE)\b)[^)]*\)\s*)?", re.IGNORECASE | re.DOTALL)


class ReadOnlyError(ValueError):
    """A statement or a file access that the read-only SQL tool refuses; the message names it."""


def check_read(sql: str) -> None:
    """ValueError unless sql is exactly one statement; ReadOnlyError unless that statement is a read (READS)."""
    statements = duckdb.extract_statements(sql)
    if len(statements) != 1:
        raise ValueError(f"only one SQL statement per query, got {len(statements)}: {sql!r:.300}")
    kind = statements[0].type
    if kind == duckdb.StatementType.EXPLAIN:  # EXPLAIN ANALYZE runs what it explains: judge that
        explain = _EXPLAIN.match(sql)
        explained = duckdb.extract_statements(sql[explain.end():]) if explain else []
        kind = explained[0].type if len(explained) == 1 else kind
    if kind != duckdb.StatementType.SELECT:
        raise ReadOnlyError(f"the store is read-only: {kind.name} statements are refused ({sql.strip()!r:.300}); "
                            f"allowed: {READS}")


class ReadOnlyFileSystem(AbstractFileSystem):
    """The store's fsspec filesystem as DuckDB sees it, read-only: files open for reading only, and every call that
    would create, change, move or remove something raises PermissionError naming it. DuckDB's own lock allows
    writing to the files it may read (see the module docstring); this one does not."""

    cachable = False  # one per connection, never shared through fsspec's instance cache

    def __init__(self, fs: AbstractFileSystem):
        super().__init__()
        self.fs, self.protocol = fs, fs.protocol  # DuckDB routes the store's URLs here by their protocol

    def _strip_protocol(self, path):
        return self.fs._strip_protocol(path)

    def _open(self, path, mode="rb", **kwargs):
        if mode != "rb":
            raise PermissionError(f"the store is read-only for SQL: cannot open {path!r} with mode {mode!r}")
        return self.fs.open(path, "rb", **kwargs)

    def info(self, path, **kwargs):
        return self.fs.info(path, **kwargs)

    def ls(self, path, detail=True, **kwargs):
        return self.fs.ls(path, detail=detail, **kwargs)

    def glob(self, path, **kwargs):
        return self.fs.glob(path, **kwargs)

    def modified(self, path):
        return self.fs.modified(path)

    def _refuse(self, path, *args, **kwargs):
        raise PermissionError(f"the store is read-only for SQL: cannot change {path!r}")

    rm = rm_file = rmdir = mv = cp_file = mkdir = makedirs = touch = pipe_file = put_file = _refuse


def lock(con: duckdb.DuckDBPyConnection, files: list[str]) -> None:
    """From now on: the views' files only (to DuckDB: any operation on them, writes included, which only
    ReadOnlyFileSystem refuses), no other file or URL, no extension, no change of settings. Set last: the secret
    and the views need the access they lose here."""
    con.execute("SET allowed_paths = ?", [files])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
