"""SQL over the run tables of ``infra.trajectories`` with DuckDB, on a local store or on S3; read-only.

``python -m infra.sql [--root ROOT] [--endpoint-url URL] [--format table|csv|json] "SQL"``, e.g.::

    python -m infra.sql "SELECT step, avg(score) FROM rollouts WHERE run_id = 'grpo-0' GROUP BY 1 ORDER BY 1"

An in-memory DuckDB gets five views over every run in the store: ``rollouts``, ``metrics``, ``validation``, ``turns``
(``run_id VARCHAR, step BIGINT, <file columns>``) and ``evals`` (``run_id VARCHAR, label VARCHAR, ...``),
each a ``read_parquet`` over the explicit list of the table's files (``{table}/run_id=*/{step|label}=*/
part-0.parquet``, listed through the store when connecting) with ``hive_partitioning`` (the partition values
are typed with ``hive_types``, so ``step`` is an integer and a label such as ``100`` stays text) and
``union_by_name`` (runs with different ``reward_*`` columns read together; missing ones are NULL). A table
with no files yet gets an empty view with the partition columns and the columns its writer writes
(``EMPTY_COLUMNS``), so ``SELECT count(*)`` gives 0 and ``avg(score)`` no rows. Views are
defined when connecting: a file written later is not seen on that connection.

Bad files: one unreadable file must not break every query over every run. A file that DuckDB cannot read
(truncated, empty, not parquet, a corrupt footer) or whose column types do not union with the other files'
is left out of its view (the reason for explicit lists) with a warning naming it, and the rest answers. Most
fail when the view is defined (``union_by_name`` reads every footer; an error naming no file, a corrupt footer's,
is bisected for its file); one that DuckDB names in an error while ``query``/``read``/the CLI runs is dropped
and the query runs again. A type conflict names the file DuckDB was casting, often a good one: the files of the
rarer of the two types go. (An odd file whose type wins the union, a STRUCT among DOUBLEs, gives the view that
type: ``avg(score)`` then fails in the binder, naming no file; ``SELECT score`` reads and drops it.) More than
``MAX_SKIPPED_FILES`` bad files on one connection is an error.

Read-only: ``query``, ``read`` and the CLI run exactly one statement, a read, and each connection is locked by
DuckDB itself; infra/sql_read_only.py says how, and what DuckDB's lock does not cover.

S3 (``s3://bucket/prefix``): DuckDB's own httpfs extension, loaded from the file shipped in the PyPI
package ``duckdb-extension-httpfs`` (``LOAD '<site-packages>/duckdb_extension_httpfs/extensions/v1.5.5/
httpfs.duckdb_extension'``: no network, nothing written to ``~/.duckdb``), with a temporary in-memory
secret built from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN`` and the region
(``AWS_REGION``/``AWS_DEFAULT_REGION``, else us-east-1); a custom endpoint gets path-style URLs and SSL only
for ``https://``. Why httpfs rather than ``con.register_filesystem(s3fs)``: it is native code (parallel
ranged reads that fetch only the parquet footers and the needed columns, no Python callbacks under the GIL),
and its errors are DuckDB's own. If the extension cannot be loaded (no package, or none built for this DuckDB
version), it warns and falls back to registering the store's s3fs filesystem, which works with any DuckDB
version; other fsspec roots (``memory://``) always use that way. Files are listed through the store either way.
Secrets are never printed: DuckDB redacts them in ``duckdb_secrets()``; a rejected secret is reported without SQL.

The command line is infra/sql_cli.py (``python -m infra.sql`` runs it).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import duckdb

from infra.config_sections import endpoint_url_problem
from infra.s3 import limit_httpfs
from infra.sql_read_only import READS, ReadOnlyError, ReadOnlyFileSystem, check_read, lock
from infra.store import ArtifactStore
from infra.trajectories import EVAL_COLUMNS, PART, STEP_TABLES, TURN_COLUMNS

logger = logging.getLogger(__name__)

# The public names of the SQL tool, wherever they are defined (infra.sql is where the rest of the project imports
# them from).
__all__ = ["READS", "ReadOnlyError", "ReadOnlyFileSystem", "check_read", "connect", "main", "query", "read",
           "s3_secret_options"]

# table -> (partition column, its DuckDB type)
VIEWS = {**{table: ("step", "BIGINT") for table in STEP_TABLES}, "evals": ("label", "VARCHAR")}
# The rows RL writes to `rollouts` (stages/rl_data.py `trajectory_rows`; `time` is its epoch seconds) and their
# DuckDB types; asynchronous runs add token_policy_versions, reward functions their `reward_<name>` components.
ROLLOUT_COLUMNS = {"group_id": "VARCHAR", "sample_index": "BIGINT", "data_source": "VARCHAR", "prompt": "VARCHAR",
                   "response": "VARCHAR", "ground_truth": "VARCHAR", "num_prompt_tokens": "BIGINT",
                   "num_response_tokens": "BIGINT", "score": "DOUBLE", "reward": "DOUBLE", "advantage": "DOUBLE",
                   "old_logprob_mean": "DOUBLE", "ref_logprob_mean": "DOUBLE", "rollout_logprob_mean": "DOUBLE",
                   "entropy_mean": "DOUBLE", "kl_mean": "DOUBLE", "finish_reason": "VARCHAR", "num_turns": "BIGINT",
                   "num_tool_calls": "BIGINT", "num_tool_errors": "BIGINT", "policy_version": "BIGINT",
                   "policy_version_max": "BIGINT", "staleness": "BIGINT", "token_policy_versions": "BIGINT[]",
                   "time": "DOUBLE"}
# The rows RL writes to `validation` (stages/validation.py `validation_samples`) and their DuckDB types.
VALIDATION_COLUMNS = {"prompt_index": "BIGINT", "data_source": "VARCHAR", "score": "DOUBLE", "acc": "DOUBLE",
                      "pred": "VARCHAR", "response": "VARCHAR", "ground_truth": "VARCHAR",
                      "num_response_tokens": "BIGINT", "finish_reason": "VARCHAR", "time": "TIMESTAMPTZ"}
# Columns of an empty view besides run_id and the partition column, so that a query over a store without that
# table's files (a fresh store, SFT only, single-turn runs' turns) returns no rows instead of a Binder Error.
EMPTY_COLUMNS = {"rollouts": ROLLOUT_COLUMNS, "metrics": {"name": "VARCHAR", "value": "DOUBLE", "time": "TIMESTAMPTZ"},
                 "validation": VALIDATION_COLUMNS, "turns": TURN_COLUMNS, "evals": EVAL_COLUMNS}
# Files a connection leaves out of its views before giving up: more than a stray bad file is a damaged store.
MAX_SKIPPED_FILES = 20
_CAST = re.compile(r'failed to cast column "(?P<column>.+?)" from type (?P<source>.+?) to (?P<target>.+?): ')
T = TypeVar("T")


def _literal(text: str) -> str:
    """A SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def _httpfs_file(con: duckdb.DuckDBPyConnection) -> Path | None:
    """The httpfs extension shipped by the duckdb-extension-httpfs package for this DuckDB version, or None."""
    spec = importlib.util.find_spec("duckdb_extension_httpfs")
    if spec is None or spec.origin is None:
        return None
    version = con.sql("PRAGMA version").fetchone()[0]  # 'v1.5.5'
    path = Path(spec.origin).parent / "extensions" / version / "httpfs.duckdb_extension"
    return path if path.is_file() else None


def _load_httpfs(con: duckdb.DuckDBPyConnection) -> bool:
    """Load httpfs offline from the PyPI package; False (with a warning) if that is not possible."""
    path = _httpfs_file(con)
    if path is None:
        logger.warning("no httpfs extension for DuckDB %s in the duckdb-extension-httpfs package; reading S3 "
                       "through s3fs instead (slower). Fix: pip install duckdb-extension-httpfs==%s",
                       duckdb.__version__, duckdb.__version__)
        return False
    try:
        con.load_extension(str(path))
    except duckdb.Error as exc:
        logger.warning("could not load %s (%s); reading S3 through s3fs instead (slower)", path, exc)
        return False
    return True


def s3_secret_options(endpoint_url: str | None, env: dict[str, str]) -> dict[str, str | bool]:
    """Options of DuckDB's ``CREATE SECRET (TYPE s3, ...)`` from the endpoint and AWS_* variables in env."""
    options: dict[str, str | bool] = {"REGION": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"}
    for option, variable in (("KEY_ID", "AWS_ACCESS_KEY_ID"), ("SECRET", "AWS_SECRET_ACCESS_KEY"),
                             ("SESSION_TOKEN", "AWS_SESSION_TOKEN")):
        if env.get(variable):
            options[option] = env[variable]
    if "KEY_ID" not in options or "SECRET" not in options:
        logger.warning("AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY are not set: reading S3 anonymously")
    if endpoint_url:
        problem = endpoint_url_problem(endpoint_url)  # the check of storage.endpoint_url: no guessed scheme
        if problem:
            raise ValueError(f"endpoint_url={endpoint_url!r} (storage.endpoint_url, --endpoint-url): {problem}")
        parts = urlsplit(endpoint_url)
        options.update(ENDPOINT=parts.netloc + parts.path.rstrip("/"), URL_STYLE="path",
                       USE_SSL=parts.scheme == "https")
    return options


def _create_s3_secret(con: duckdb.DuckDBPyConnection, endpoint_url: str | None) -> None:
    options = s3_secret_options(endpoint_url, dict(os.environ))
    body = ", ".join(f"{key} {str(value).lower() if isinstance(value, bool) else _literal(value)}"
                     for key, value in options.items())
    try:
        con.execute(f"CREATE TEMPORARY SECRET rlpipe_s3 (TYPE s3, {body})")
    except duckdb.Error as exc:  # its message could quote the statement, which holds the secret
        raise ValueError(f"DuckDB rejected the S3 settings ({type(exc).__name__}) for "
                         f"endpoint_url={endpoint_url!r}; check the AWS_* variables and --endpoint-url") from None


def _attach_storage(con: duckdb.DuckDBPyConnection, store: ArtifactStore) -> None:
    """Make store.url() paths readable by con (local paths need nothing)."""
    if not store.is_remote:
        return
    if store.root.startswith("s3://") and _load_httpfs(con):
        _create_s3_secret(con, store.endpoint_url)
        limit_httpfs(con, store.limits)  # the store's timeout and attempts per request
    else:
        con.register_filesystem(ReadOnlyFileSystem(store.fs))


def _select(table: str, files: list[str]) -> str:
    """The SELECT of a view over exactly these files; no files: no rows, with the partition columns."""
    key, key_type = VIEWS[table]
    if not files:
        columns = {"run_id": "VARCHAR", key: key_type, **EMPTY_COLUMNS.get(table, {})}
        return "SELECT " + ", ".join(f"NULL::{kind} AS {name}" for name, kind in columns.items()) + " WHERE false"
    return (f"SELECT run_id, {key}, * EXCLUDE (run_id, {key}) FROM read_parquet([{', '.join(map(_literal, files))}], "
            f"hive_partitioning=true, union_by_name=true, hive_types={{'run_id': VARCHAR, '{key}': {key_type}}})")


class _Views:
    """The views of one connection, each over an explicit list of the store's files, so that a file DuckDB
    cannot read is dropped from its view (with a warning naming it) instead of failing every query."""

    def __init__(self, con: duckdb.DuckDBPyConnection, store: ArtifactStore):
        self.con = con
        self.files = {table: [store.url(rel) for rel in store.glob(f"{table}/run_id=*/{key}=*/{PART}")]
                      for table, (key, _) in VIEWS.items()}
        self.num_skipped = 0

    def define(self, table: str) -> None:
        """(Re)create the view of table; union_by_name reads every footer here, so unreadable files show now."""
        while True:
            try:
                self.con.execute(f"CREATE OR REPLACE VIEW {table} AS {_select(table, self.files[table])}")
                return
            except duckdb.Error as exc:
                found = self._culprits(exc)
                if found is None and not isinstance(exc, duckdb.IOException):  # IO: the store, not a file
                    bad = self._unreadable(table, self.files[table])
                    why = f"DuckDB cannot read its footer ({str(exc).splitlines()[0]})"
                    found = (table, [bad], why) if bad else None
                if found is None:
                    raise
                self._skip(*found, exc)

    def run(self, reader: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
        """reader(con); on an error caused by some of the store's files, drop them, redefine the view, retry."""
        while True:
            try:
                return reader(self.con)
            except duckdb.Error as exc:
                found = self._culprits(exc)
                if found is None:
                    raise
                self._skip(*found, exc)
                self.define(found[0])

    def _culprits(self, exc: duckdb.Error) -> tuple[str, list[str], str] | None:
        """(table, files to drop, why) for an error that names one of the views' files, else None."""
        message = str(exc)
        named = next(((table, url) for table, urls in self.files.items() for url in urls if url in message), None)
        if named is None:
            return None
        cast = _CAST.search(message)
        if isinstance(exc, duckdb.ConversionException) and cast:
            return self._rarer_type(named[0], cast["column"], cast["source"], cast["target"])
        if isinstance(exc, duckdb.InvalidInputException):  # not parquet, truncated, empty, bad magic
            return named[0], [named[1]], message.splitlines()[0]
        return None

    def _rarer_type(self, table: str, column: str, source: str, target: str) -> tuple[str, list[str], str] | None:
        """A column whose types cannot be unioned: the files of the rarer of the two types (the named file's,
        source, on a tie) are the odd ones. DuckDB names whichever file it was reading, often a good one."""
        types = {url: self._column_type(table, url, column) for url in self.files[table]}
        sources = [url for url, kind in types.items() if kind == source]
        targets = [url for url, kind in types.items() if kind == target]
        bad, bad_type, good, good_type = ((sources, source, targets, target) if len(sources) <= len(targets)
                                          else (targets, target, sources, source))
        if not bad:
            return None
        return table, bad, (f"column {column!r} is {bad_type} here and {good_type} in {len(good)} other files; "
                            "DuckDB cannot union the two")

    def _column_type(self, table: str, url: str, column: str) -> str | None:
        found = self.con.execute(f"SELECT column_type FROM (DESCRIBE {_select(table, [url])}) WHERE column_name = ?",
                                 [column]).fetchone()
        return found and found[0]

    def _unreadable(self, table: str, files: list[str]) -> str | None:
        """Bisect for a file whose footer DuckDB cannot read (its error, a thrift one, names no file); None if
        every half reads alone (the error is not one file's)."""
        try:
            self.con.execute(f"DESCRIBE {_select(table, files)}")
            return None
        except duckdb.Error:
            if len(files) == 1:
                return files[0]
        half = len(files) // 2
        return self._unreadable(table, files[:half]) or self._unreadable(table, files[half:])

    def _skip(self, table: str, bad: list[str], why: str, exc: duckdb.Error) -> None:
        self.num_skipped += len(bad)
        if self.num_skipped > MAX_SKIPPED_FILES:
            raise ValueError(f"more than {MAX_SKIPPED_FILES} unreadable files in the store's tables (the last: "
                             f"{', '.join(bad)}: {why}); the store is damaged: restore or delete those files") from exc
        for url in bad:
            logger.warning("skipping %s: %s. The query reads the other files; fix: restore or delete that file",
                           url, why)
            self.files[table].remove(url)


def _open(store_or_root: ArtifactStore | str, endpoint_url: str | None) -> _Views:
    store = store_or_root if isinstance(store_or_root, ArtifactStore) else ArtifactStore(store_or_root, endpoint_url)
    if store.is_remote:
        store.check()  # a missing bucket or a dead endpoint: one StoreError naming it, before any listing
    # No extension is installed or loaded behind our back; httpfs is loaded explicitly from its file.
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    try:
        con.execute("SET TimeZone = 'UTC'")  # show the UTC `time` columns as UTC whatever the machine's zone
        _attach_storage(con, store)
        views = _Views(con, store)
        for table in VIEWS:
            views.define(table)
        lock(con, [url for urls in views.files.values() for url in urls])
    except BaseException:
        con.close()
        raise
    return views


def connect(store_or_root: ArtifactStore | str, endpoint_url: str | None = None) -> duckdb.DuckDBPyConnection:
    """A locked in-memory DuckDB with the views rollouts, metrics, validation, turns and evals over every run in the
    store; unreadable files are left out of the views with a warning. Its statements are not checked (use
    query() or read() for SQL from users), nor retried when a file fails only while a query runs."""
    return _open(store_or_root, endpoint_url).con


def read(store_or_root: ArtifactStore | str, reader: Callable[[duckdb.DuckDBPyConnection], T],
         endpoint_url: str | None = None) -> T:
    """reader(con) on a connect()ion; if it fails on some of the store's files, reader runs again without them."""
    views = _open(store_or_root, endpoint_url)
    try:
        return views.run(reader)
    except duckdb.PermissionException as exc:
        raise ReadOnlyError(f"the store is read-only: {' '.join(str(exc).split())}; only the store's run "
                            "tables can be read") from None
    finally:
        views.con.close()


def query(root: ArtifactStore | str, sql: str, endpoint_url: str | None = None) -> list[dict]:
    """Run one read (check_read) over the store's views; -> rows as dicts (column name -> Python value)."""
    check_read(sql)

    def rows(con: duckdb.DuckDBPyConnection) -> list[dict]:
        rel = con.sql(sql)
        return [dict(zip(rel.columns, row)) for row in rel.fetchall()]

    return read(root, rows, endpoint_url)


def main(argv: list[str] | None = None) -> None:
    """The command line (infra/sql_cli.py)."""
    from infra.sql_cli import main as cli_main

    cli_main(argv)


if __name__ == "__main__":
    main()
