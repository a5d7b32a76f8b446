"""What keeps SQL over the store read-only (infra/sql.py opens the connections).

Read-only: ``query``, ``read`` and the CLI run exactly one statement, a read (``READS``); anything else (COPY,
CREATE, INSERT, SET, PRAGMA settings, INSTALL/LOAD, ATTACH, ...) is a ``ReadOnlyError`` naming its type. Statements
are judged on DuckDB's own parser and tokenizer, never on the text: comments are not tokens and a string literal is
one token, so neither can hide or fake a statement. ``EXPLAIN ANALYZE`` runs what it explains, so an EXPLAIN is
judged by the statement it explains: the text after ``EXPLAIN [ANALYZE]``, or after the option list in parentheses
(``EXPLAIN (FORMAT json, ANALYZE) ...``; its end is the matching ``)`` token); every one of the two readings that
DuckDB parses as one statement must be a read, and an EXPLAIN where neither does is refused. Each
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
# Words between EXPLAIN and what it explains (DuckDB's grammar: EXPLAIN [ANALYZE|ANALYSE] [VERBOSE] stmt).
_EXPLAIN_MODES = frozenset({"ANALYZE", "ANALYSE", "VERBOSE"})
_WORD = re.compile(r"\w+")


class ReadOnlyError(ValueError):
    """A statement or a file access that the read-only SQL tool refuses; the message names it."""


def check_read(sql: str) -> None:
    """ValueError unless sql is exactly one statement; ReadOnlyError unless that statement is a read (READS)."""
    statements = duckdb.extract_statements(sql)
    if len(statements) != 1:
        raise ValueError(f"only one SQL statement per query, got {len(statements)}: {sql!r:.300}")
    kind = statements[0].type
    if kind == duckdb.StatementType.EXPLAIN:  # EXPLAIN ANALYZE runs what it explains: judge that
        kind = _explained_kind(sql)
    if kind != duckdb.StatementType.SELECT:
        raise ReadOnlyError(f"the store is read-only: {kind.name} statements are refused ({sql.strip()!r:.300}); "
                            f"allowed: {READS}")


def _explained_kind(sql: str) -> duckdb.StatementType:
    """The type of the statement that the EXPLAIN sql explains: SELECT only if every reading of it is a read."""
    kinds = [_one_statement(sql[start:]) for start in _explained_starts(sql)]
    kinds = [kind for kind in kinds if kind is not None]
    if not kinds:
        raise ReadOnlyError(f"the store is read-only: cannot tell which statement this EXPLAIN explains "
                            f"({sql.strip()!r:.300}); write it as EXPLAIN [ANALYZE] <a read>, allowed: {READS}")
    return next((kind for kind in kinds if kind != duckdb.StatementType.SELECT), duckdb.StatementType.SELECT)


def _explained_starts(sql: str) -> list[int]:
    """Where the explained statement can start, on DuckDB's tokens: after EXPLAIN [ANALYZE] [VERBOSE], and, when
    a '(' follows, also after its matching ')' (an option list: EXPLAIN (FORMAT json, ANALYZE) SELECT ...)."""
    tokens = duckdb.tokenize(sql)
    starts = [start for start, _ in tokens]

    def word(i: int) -> str:
        found = _WORD.match(sql, starts[i]) if tokens[i][1] == duckdb.token_type.keyword else None
        return found.group().upper() if found else ""

    if not starts or word(0) != "EXPLAIN":
        return []
    first = 1
    while first < len(starts) and word(first) in _EXPLAIN_MODES:
        first += 1
    if first == len(starts):
        return []
    close = _matching_paren(sql, tokens, first)
    return [starts[first]] + ([starts[close + 1]] if close is not None and close + 1 < len(starts) else [])


def _matching_paren(sql: str, tokens: list, i: int) -> int | None:
    """The index of the ')' token that closes the '(' token i; None if token i is not '(' or nothing closes it.
    DuckDB's '(' and ')' are always tokens of their own; inside a string literal or a comment they are none."""
    depth = 0
    for j in range(i, len(tokens)):
        start, kind = tokens[j]
        if kind == duckdb.token_type.operator and sql[start] in "()":
            depth += 1 if sql[start] == "(" else -1
        if depth == 0:
            return j if j > i else None
    return None


def _one_statement(sql: str) -> duckdb.StatementType | None:
    """The type of sql if DuckDB parses it as exactly one statement, else None."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error:
        return None
    return statements[0].type if len(statements) == 1 else None


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
