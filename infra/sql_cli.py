"""The SQL command line, ``python -m infra.sql [--root R] [--endpoint-url U] [--format table|csv|json]
[--max-rows N] "SQL"`` (infra/sql.py runs ``main``; it says what the views hold and how bad files are skipped);
``python -m infra.sql_cli`` runs the same.

Exit status: 0; 1 for a statement that fails or is refused (not one read) and for a storage failure; 2 for bad
input: a root that holds no store (the message names it; looking never creates one) or a bad option.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from datetime import date, datetime, time, timedelta
from decimal import Decimal

import duckdb

import infra.sql
from infra.sql import read
from infra.sql_read_only import READS, check_read
from infra.store import ArtifactStore, StoreError

FORMATS = ("table", "csv", "json")


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
    from infra.config_sections import StorageConfig

    default = StorageConfig()
    parser = argparse.ArgumentParser(
        prog="python -m infra.sql", description=infra.sql.__doc__.split("\n\n")[0],
        epilog="views: rollouts, metrics, validation, turns (run_id, step, ...); evals (run_id, label, ...). The "
               f"store is read-only: one statement, a read ({READS}); refused: writes (COPY, CREATE, INSERT, ...), "
               "SET/PRAGMA settings, INSTALL/LOAD, ATTACH, and any file or URL outside the store's run tables. A file "
               "DuckDB cannot read is skipped with a warning naming it.")
    parser.add_argument("sql", help="one read statement, e.g. \"SELECT count(*) FROM rollouts\"")
    parser.add_argument("--root", default=default.root, help="local folder or s3://bucket/prefix")
    parser.add_argument("--endpoint-url", default=default.endpoint_url, help="S3 endpoint (or AWS_ENDPOINT_URL)")
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    parser.add_argument("--max-rows", type=_max_rows, default=40,
                        help="rows shown by --format table, an integer >= 1 (default: 40; the count of rows and of "
                             "those shown is printed); csv/json print all")
    args = parser.parse_args(argv)
    try:
        store = _existing_store(args.root, args.endpoint_url)
        check_read(args.sql)
        read(store, lambda con: _print(con.sql(args.sql), args.format, args.max_rows))
    except (duckdb.Error, StoreError, ValueError) as exc:
        raise SystemExit("error: " + " ".join(str(exc).split())) from None


def _max_rows(text: str) -> int:
    """--max-rows: an integer >= 1 (argparse reports the error, naming the option, and exits 2)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1, the number of rows --format table "
                                         "shows (e.g. --max-rows 100); csv/json print every row")
    return value


def _existing_store(root: str, endpoint_url: str | None) -> ArtifactStore:
    """The store at root; exit status 2 (bad input, as argparse's) when root is not one or holds nothing."""
    try:
        store = ArtifactStore(root, endpoint_url)
        store.check_exists()
    except (FileNotFoundError, ValueError) as exc:
        print("error: " + " ".join(str(exc).split()), file=sys.stderr)
        raise SystemExit(2) from None
    return store


if __name__ == "__main__":
    main()
