"""infra.sql on a real local S3 server (moto), through httpfs and through the s3fs fallback: a bad file of another
run is skipped with a warning naming its s3:// URL, and the SQL tool can neither write to the store nor read
outside its run tables."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import duckdb
import pytest

from infra import report, sql
from infra.store import ArtifactStore
from infra.trajectories import RunTables, rows_to_table, to_parquet_bytes
from tests.unit import test_report
from tests.unit.test_sql_bad_files import BAD, ODD_TYPES, QUERY, ROWS, skipped, truncated, write_bad
from tests.unit.test_trajectories import PROJECT, T0, write_scores

pytestmark = pytest.mark.s3

JOIN = ("SELECT r.step, avg(r.score) AS s, any_value(m.value) AS loss FROM rollouts r JOIN metrics m "
        "USING (run_id, step) WHERE r.run_id = 'run-a' GROUP BY 1 ORDER BY 1")


def new_store(s3_server, tmp_path) -> ArtifactStore:
    """run-a and run-b (rollouts, steps 1-3) and run-a's metrics (pg_loss = step / 4) in a fresh bucket."""
    bucket = s3_server.create_bucket()
    store = ArtifactStore(f"s3://{bucket}/prefix", endpoint_url=s3_server.endpoint_url, cache_dir=tmp_path / "cache")
    write_scores(store)
    for step in (1, 2, 3):
        RunTables(store, "run-a").write_metrics(step, {"actor/pg_loss": step / 4})
    return store


@pytest.fixture(params=["httpfs", "s3fs"])
def s3_store(request, s3_server, tmp_path, monkeypatch) -> ArtifactStore:
    if request.param == "s3fs":
        monkeypatch.setattr(sql, "_httpfs_file", lambda con: None)  # as if no httpfs was built for this DuckDB
    return new_store(s3_server, tmp_path)


def objects(s3_server, store: ArtifactStore) -> dict[str, str]:
    """key -> ETag of every object in the store's bucket."""
    bucket = store.root.removeprefix("s3://").split("/")[0]
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {obj["Key"]: obj["ETag"] for page in pages for obj in page.get("Contents", [])}


def test_reads_work(s3_store):
    assert sql.query(s3_store, JOIN) == [{"step": 1, "s": 0.5, "loss": 0.25}, {"step": 2, "s": 1.0, "loss": 0.5},
                                         {"step": 3, "s": 0.25, "loss": 0.75}]  # as in tests/unit/test_sql_read_only


@pytest.mark.parametrize("make", BAD, ids=lambda make: make.__name__)
def test_a_bad_file_of_another_run_is_skipped(s3_store, make, caplog):
    expected = sql.query(s3_store, QUERY)
    url = write_bad(s3_store, make)
    assert url.startswith("s3://")
    with caplog.at_level(logging.WARNING, logger="infra.sql"):
        assert sql.query(s3_store, QUERY) == expected
    [message] = skipped(caplog)
    assert message.startswith(f"skipping {url}: ")


@pytest.mark.parametrize(("column", "value", "odd_type", "good_type"), ODD_TYPES, ids=[c[0] for c in ODD_TYPES])
def test_columns_that_do_not_union_skip_the_odd_file_only(s3_store, caplog, column, value, odd_type, good_type):
    expected = sql.query(s3_store, ROWS)
    RunTables(s3_store, "run-bad").write_rollouts(1, [{"score": 0.5, "time": T0, column: value}])
    with caplog.at_level(logging.WARNING, logger="infra.sql"):
        assert sql.query(s3_store, ROWS) == expected
    [message] = skipped(caplog)
    url = s3_store.url("rollouts/run_id=run-bad/step=00000001/part-0.parquet")
    assert message.startswith(f"skipping {url}: column {column!r} is {odd_type} here and {good_type} in 6 other ")


def test_report_survives_a_corrupt_file_of_another_run(s3_store, caplog):
    test_report.write_run(s3_store)
    expected = report.read_run(s3_store, test_report.RUN)
    url = write_bad(s3_store, truncated, "metrics")
    with caplog.at_level(logging.WARNING, logger="infra.sql"):
        assert report.read_run(s3_store, test_report.RUN) == expected
    assert any(url in m for m in skipped(caplog))


def test_the_store_cannot_be_written(s3_store, s3_server):
    before = objects(s3_server, s3_store)
    new_file = s3_store.url("rollouts/run_id=x/step=00000001/part-0.parquet")
    own_file = s3_store.url("rollouts/run_id=run-a/step=00000001/part-0.parquet")  # a file of the views
    for target in (new_file, own_file):
        with pytest.raises(sql.ReadOnlyError, match="^the store is read-only: COPY statements are refused"):
            sql.query(s3_store, f"COPY (SELECT 1 AS score) TO '{target}'")
    # Below the statement check DuckDB refuses a new file too (the views' own files are allowed paths: for
    # reading, and to DuckDB for writing as well, so only the statement check guards those).
    with pytest.raises(duckdb.PermissionException, match="Cannot access file"):
        sql.connect(s3_store).execute(f"COPY (SELECT 1 AS score) TO '{new_file}'")
    assert objects(s3_server, s3_store) == before


def test_nothing_outside_the_run_tables_can_be_read(s3_store, s3_server):
    other = s3_server.create_bucket()
    s3_server.client().put_object(Bucket=other, Key="x.parquet", Body=to_parquet_bytes(rows_to_table([{"a": 1}], T0)))
    s3_store.write_bytes("runs/x/report.html", b"a\n1\n")
    for url, reader in ((f"s3://{other}/x.parquet", "read_parquet"), (s3_store.url("runs/x/report.html"), "read_csv")):
        with pytest.raises(sql.ReadOnlyError, match=f'^the store is read-only: .*Cannot access file "{url}"'):
            sql.query(s3_store, f"SELECT * FROM {reader}('{url}')")


def test_cli_refuses_a_copy_into_the_store(s3_server, tmp_path):
    store = new_store(s3_server, tmp_path)
    before = objects(s3_server, store)
    target = store.url("rollouts/run_id=x/step=00000001/part-0.parquet")
    done = subprocess.run([sys.executable, "-m", "infra.sql", "--root", store.root, "--endpoint-url",
                           store.endpoint_url, f"COPY (SELECT 1 AS score) TO '{target}'"], cwd=PROJECT,
                          capture_output=True, text=True, check=False, timeout=120, env=os.environ)
    assert done.returncode == 1 and done.stderr.startswith("error: the store is read-only: COPY"), done.stderr
    assert objects(s3_server, store) == before
