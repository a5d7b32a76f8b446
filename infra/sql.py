"""SQL over the run tables of ``infra.trajectories`` with DuckDB, on a local store or on S3.

``python -m infra.sql [--root ROOT] [--endpoint-url URL] [--format table|csv|json] "SQL"``, e.g.::

    python -m infra.sql "SELECT step, avg(score) FROM rollouts WHERE run_id = 'grpo-0' GROUP BY 1 ORDER BY 1"

An in-memory DuckDB gets four views over every run in the store: ``rollouts``, ``metrics``, ``validation``
(``run_id VARCHAR, step BIGINT, <file columns>``) and ``evals`` (``run_id VARCHAR, label VARCHAR, ...``),
each a ``read_parquet`` over ``{table}/run_id=*/{step|label}=*/*.parquet`` with ``hive_partitioning`` (the
partition values are typed with ``hive_types``, so ``step`` is an integer and a label such as ``100`` stays
text) and ``union_by_name`` (runs with different ``reward_*`` columns read together; missing ones are
NULL). A table with no files yet gets an empty view with the partition columns, so ``SELECT count(*)``
gives 0. Views are defined when connecting: a table that was empty then stays empty on that connection.

S3 (``s3://bucket/prefix``): DuckDB's own httpfs extension, loaded from the file shipped in the PyPI
package ``duckdb-extension-httpfs`` (``LOAD '<site-packages>/duckdb_extension_httpfs/extensions/v1.5.5/
httpfs.duckdb_extension'``: no network, nothing written to ``~/.duckdb``), with a temporary in-memory
secret built from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN`` and the region
(``AWS_REGION``/``AWS_DEFAULT_REGION``, else us-east-1); a custom endpoint gets path-style URLs and SSL only
for ``https://``. Why httpfs rather than ``con.register_filesystem(s3fs)``: it is native code (parallel
ranged reads that fetch only the parquet footers and the needed columns, no Python callbacks under the GIL),
and its globbing, hive partitioning and errors are DuckDB's own. If the extension cannot be loaded (no
package, or none built for this DuckDB version), it warns and falls back to registering the store's s3fs
filesystem, which works with any DuckDB version; other fsspec roots (``memory://``) always use that way.
Secrets are never printed: DuckDB redacts them in ``duckdb_secrets()`` and a rejected secret is reported
without its SQL.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import logging
import math
import os
import sys
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path
from urllib.parse import urlsplit

import duckdb

from infra.store import ArtifactStore, StoreError
from infra.trajectories import EVAL_COLUMNS, PART, STEP_TABLES

logger = logging.getLogger(__name__)

# table -> (partition column, its DuckDB type)
VIEWS = {**{table: ("step", "BIGINT") for table in STEP_TABLES}, "evals": ("label", "VARCHAR")}
# Columns of an empty view besides run_id and the partition column (metrics and the pipeline's evals have a
# fixed schema).
EMPTY_COLUMNS = {"metrics": {"name": "VARCHAR", "value": "DOUBLE", "time": "TIMESTAMPTZ"}, "evals": EVAL_COLUMNS}
FORMATS = ("table", "csv", "json")


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
        parts = urlsplit(endpoint_url if "://" in endpoint_url else f"https://{endpoint_url}")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"endpoint_url={endpoint_url!r}: expected http(s)://host[:port], "
                             "e.g. http://127.0.0.1:9000")
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
    else:
        con.register_filesystem(store.fs)


def _view_sql(con: duckdb.DuckDBPyConnection, store: ArtifactStore, table: str) -> str:
    key, key_type = VIEWS[table]
    pattern = _literal(f"{store.url(table)}/run_id=*/{key}=*/{PART}")
    if con.sql(f"SELECT count(*) FROM glob({pattern})").fetchone()[0] == 0:
        columns = {"run_id": "VARCHAR", key: key_type, **EMPTY_COLUMNS.get(table, {})}
        select = ", ".join(f"NULL::{kind} AS {name}" for name, kind in columns.items())
        return f"CREATE VIEW {table} AS SELECT {select} WHERE false"
    return (f"CREATE VIEW {table} AS SELECT run_id, {key}, * EXCLUDE (run_id, {key}) FROM read_parquet("
            f"{pattern}, hive_partitioning=true, union_by_name=true, "
            f"hive_types={{'run_id': VARCHAR, '{key}': {key_type}}})")


def connect(store_or_root: ArtifactStore | str, endpoint_url: str | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with the views rollouts, metrics, validation and evals over every run in the store."""
    store = store_or_root if isinstance(store_or_root, ArtifactStore) else ArtifactStore(store_or_root, endpoint_url)
    con = duckdb.connect()
    try:
        con.execute("SET TimeZone = 'UTC'")  # show the UTC `time` columns as UTC whatever the machine's zone
        _attach_storage(con, store)
        for table in VIEWS:
            con.execute(_view_sql(con, store, table))
    except BaseException:
        con.close()
        raise
    return con


def query(root: ArtifactStore | str, sql: str, endpoint_url: str | None = None) -> list[dict]:
    """Run sql over the store's views; -> rows as dicts (column name -> Python value); [] for statements."""
    con = connect(root, endpoint_url)
    try:
        rel = con.sql(sql)
        if rel is None:
            return []
        return [dict(zip(rel.columns, row)) for row in rel.fetchall()]
    finally:
        con.close()


# -------------------------------------------------------------------------------------------------- CLI


def _jsonable(value):
    """json.dumps fallback for DuckDB's Python values."""
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)  # UUID, intervals, ...


def _finite(value):
    """NaN/inf -> their names as strings (JSON has no literal for them)."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def _print(rel: duckdb.DuckDBPyRelation, fmt: str, max_rows: int) -> None:
    if fmt == "table":
        rel.show(max_rows=max_rows)
        return
    columns, rows = rel.columns, rel.fetchall()
    if fmt == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)
    else:
        records = [{name: _finite(value) for name, value in zip(columns, row)} for row in rows]
        print(json.dumps(records, default=_jsonable, ensure_ascii=False, indent=1))


def main(argv: list[str] | None = None) -> None:
    """python -m infra.sql [--root R] [--endpoint-url U] [--format table|csv|json] [--max-rows N] "SQL" """
    from infra.config import StorageConfig

    default = StorageConfig()
    parser = argparse.ArgumentParser(prog="python -m infra.sql", description=__doc__.split("\n\n")[0],
                                     epilog="views: rollouts, metrics, validation (run_id, step, ...); "
                                            "evals (run_id, label, ...)")
    parser.add_argument("sql", help="one SQL statement, e.g. \"SELECT count(*) FROM rollouts\"")
    parser.add_argument("--root", default=default.root, help="local folder or s3://bucket/prefix")
    parser.add_argument("--endpoint-url", default=default.endpoint_url, help="S3 endpoint (or AWS_ENDPOINT_URL)")
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    parser.add_argument("--max-rows", type=int, default=40,
                        help="rows shown by --format table (the count of hidden rows is printed); csv/json print all")
    args = parser.parse_args(argv)
    try:
        con = connect(args.root, args.endpoint_url)
        rel = con.sql(args.sql)
        if rel is not None:
            _print(rel, args.format, args.max_rows)
    except (duckdb.Error, StoreError, ValueError) as exc:
        raise SystemExit("error: " + " ".join(str(exc).split())) from None


if __name__ == "__main__":
    main()
