"""infra.sql is read-only: one statement, a read, over the store's run tables and nothing else; the connection
itself is locked by DuckDB's settings, so even code that skips the statement check cannot write or escape."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import duckdb
import pytest

from infra import sql
from infra.store import ArtifactStore
from infra.trajectories import RunTables
from tests.unit.test_trajectories import PROJECT, write_scores


@pytest.fixture
def local(tmp_path) -> ArtifactStore:
    """run-a and run-b (rollouts, steps 1-3) and run-a's metrics (pg_loss = step / 4)."""
    store = ArtifactStore(str(tmp_path / "store"), cache_dir=tmp_path / "cache")
    write_scores(store)
    for step in (1, 2, 3):
        RunTables(store, "run-a").write_metrics(step, {"actor/pg_loss": step / 4})
    return store


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_reads_work_views_aggregates_joins(local):
    join = ("SELECT r.step, avg(r.score) AS s, any_value(m.value) AS loss FROM rollouts r JOIN metrics m "
            "USING (run_id, step) WHERE r.run_id = 'run-a' GROUP BY 1 ORDER BY 1")
    assert sql.query(local, join) == [{"step": 1, "s": 0.5, "loss": 0.25}, {"step": 2, "s": 1.0, "loss": 0.5},
                                      {"step": 3, "s": 0.25, "loss": 0.75}]  # scores (0+1)/2, (1+1)/2, (.5+0)/2
    last = sql.query(local, "WITH t AS (SELECT run_id, max(step) AS last FROM rollouts GROUP BY 1) SELECT * FROM t "
                            "ORDER BY 1")
    assert last == [{"run_id": "run-a", "last": 3}, {"run_id": "run-b", "last": 3}]
    assert sql.query(local, "FROM metrics SELECT count(*) AS n;") == [{"n": 3}]
    assert {"run_id", "step", "score"} <= {r["column_name"] for r in sql.query(local, "DESCRIBE rollouts")}
    tables = {r["name"] for r in sql.query(local, "SHOW TABLES")}
    assert tables == {"rollouts", "metrics", "validation", "turns", "evals"}
    assert sql.query(local, "-- the plan\nEXPLAIN ANALYZE SELECT count(*) FROM rollouts")[0]["explain_key"] == \
        "analyzed_plan"
    own_file = local.url("rollouts/run_id=run-a/step=00000001/part-0.parquet")  # a table file: the store's own
    assert sql.query(local, f"SELECT count(*) AS n FROM read_parquet('{own_file}')") == [{"n": 2}]


@pytest.mark.parametrize("statement", ["SELECT 1; SELECT 2", "SELECT 1; COPY (SELECT 1) TO '{out}'", "", "-- only",
                                       "SELECT 1 /* ; */; COPY (SELECT 1) TO '{out}' -- ;"])
def test_exactly_one_statement(local, tmp_path, statement):
    out = tmp_path / "out.csv"
    with pytest.raises(ValueError, match="only one SQL statement per query, got [02]"):
        sql.query(local, statement.format(out=out))
    assert not out.exists()


REFUSED = [  # (statement, the type named in the error)
    ("COPY (SELECT * FROM rollouts) TO '{out}'", "COPY"),
    ("COPY (SELECT 1 AS score) TO '{store}/rollouts/run_id=x/step=00000001/part-0.parquet'", "COPY"),
    # a file of the views, written in place: DuckDB itself would allow it (see test_the_connection_itself_is_locked)
    ("COPY (SELECT 42) TO '{store}/rollouts/run_id=run-a/step=00000001/part-0.parquet' (FORMAT csv, "
     "USE_TMP_FILE false)", "COPY"),
    ("EXPLAIN ANALYZE COPY (SELECT 1) TO '{out}'", "COPY"),  # EXPLAIN ANALYZE runs it
    ("EXPLAIN (FORMAT json, ANALYZE) COPY (SELECT 1) TO '{out}'", "COPY"),
    ("EXPORT DATABASE '{out}'", "EXPORT"),
    ("CREATE TABLE t AS SELECT * FROM rollouts", "CREATE"),
    ("CREATE OR REPLACE VIEW rollouts AS SELECT 1 AS x", "CREATE"),
    ("INSERT INTO rollouts (score) VALUES (1)", "INSERT"),
    ("DROP VIEW metrics", "DROP"),
    ("INSTALL httpfs", "LOAD"),
    ("LOAD httpfs", "LOAD"),
    ("ATTACH '{out}' AS other", "ATTACH"),
    ("SET enable_external_access = true", "SET"),
    ("RESET lock_configuration", "SET"),
    ("PRAGMA threads = 1", "SET"),
    ("PRAGMA enable_profiling", "PRAGMA"),
    ("CALL pragma_version()", "CALL"),
    # the end of EXPLAIN's option list is its ')' token, not a ')' in a comment: read as text, "SELECT 1--*/) ..."
    # looked like the explained statement while DuckDB ran the COPY, overwriting (csv) or truncating to 0 bytes
    # (parquet, reading the file it writes) a file of the store
    ("EXPLAIN (ANALYZE /*)SELECT 1--*/) COPY (SELECT 42) TO '{store}/rollouts/run_id=run-a/step=00000001/"
     "part-0.parquet' (FORMAT csv, USE_TMP_FILE false)", "COPY"),
    ("EXPLAIN (ANALYZE /*)SELECT 1--*/) COPY (FROM read_parquet('{store}/rollouts/run_id=run-a/step=00000001/"
     "part-0.parquet')) TO '{store}/rollouts/run_id=run-a/step=00000001/part-0.parquet' (FORMAT parquet, "
     "USE_TMP_FILE false)", "COPY"),
    ("EXPLAIN (ANALYZE -- )\n) COPY (SELECT 1) TO '{out}'", "COPY"),
    ("EXPLAIN (FORMAT json, /* ) */ ANALYZE) COPY (SELECT 1) TO '{out}'", "COPY"),
    ("/* EXPLAIN ANALYZE SELECT 1 */ EXPLAIN ANALYZE INSERT INTO rollouts (score) VALUES (1)", "INSERT"),
    ("CREATE TEMPORARY SECRET s (TYPE s3, KEY_ID 'k', SECRET 's')", "CREATE"),
    ("PREPARE p AS COPY (SELECT 1) TO '{out}'", "PREPARE"),
    ("UPDATE rollouts SET score = 1", "UPDATE"),
    ("USE memory", "SET"),
    ("DETACH memory", "DETACH"),
    ("VACUUM", "VACUUM"),
    ("LOAD '{out}'", "LOAD"),
]


@pytest.mark.parametrize(("statement", "kind"), REFUSED, ids=[s for s, _ in REFUSED])
def test_writes_settings_extensions_and_attach_are_refused(local, tmp_path, statement, kind):
    before = snapshot(tmp_path)
    out = tmp_path / "out.csv"
    with pytest.raises(sql.ReadOnlyError, match=f"^the store is read-only: {kind} statements are refused"):
        sql.query(local, statement.format(out=out, store=local.root))
    assert snapshot(tmp_path) == before


READS_WITH_COMMENTS_AND_STRINGS = [  # reads that keep working: keywords in comments and strings are no statements
    "EXPLAIN (SELECT count(*) FROM rollouts)",
    "EXPLAIN (FORMAT json, ANALYZE) (SELECT count(*) FROM rollouts)",
    "/* EXPLAIN (ANALYZE */ EXPLAIN ANALYZE -- ) COPY (SELECT 1) TO 'x'\nSELECT count(*) FROM rollouts",
    "SELECT 'COPY (SELECT 1) TO ''x''; DROP VIEW metrics' AS s -- ; COPY (SELECT 1) TO 'y'",
    "EXPLAIN ANALYZE SUMMARIZE rollouts",
    "PIVOT rollouts ON run_id IN ('run-a', 'run-b') USING count(*) GROUP BY step",
]


@pytest.mark.parametrize("statement", READS_WITH_COMMENTS_AND_STRINGS)
def test_reads_with_keywords_in_comments_and_strings_are_allowed(local, statement):
    assert sql.query(local, statement)


def test_a_statement_inside_a_string_does_not_run(local, tmp_path):
    """query('...') runs the SQL of a string: DuckDB itself takes only a SELECT there."""
    before = snapshot(tmp_path)
    table_file = local.url("rollouts/run_id=run-a/step=00000001/part-0.parquet")
    with pytest.raises(duckdb.ParserException, match="Expected a single SELECT statement"):
        sql.query(local, f"SELECT * FROM query('COPY (SELECT 42) TO ''{table_file}'' (FORMAT csv, "
                         "USE_TMP_FILE false)')")
    assert snapshot(tmp_path) == before


def test_an_explain_that_cannot_be_judged_is_refused(monkeypatch):
    """Where the explained statement cannot be found on DuckDB's tokens, the EXPLAIN is refused, not allowed."""
    monkeypatch.setattr(duckdb, "tokenize", lambda text: [])
    with pytest.raises(sql.ReadOnlyError, match="cannot tell which statement this EXPLAIN explains"):
        sql.check_read("EXPLAIN ANALYZE SELECT 1")


@pytest.mark.parametrize("reader", ["read_text", "read_csv", "read_blob", "read_parquet", "glob"])
def test_files_outside_the_run_tables_are_refused(local, tmp_path, reader):
    outside = tmp_path / "secret.csv"
    outside.write_text("a,b\n1,2\n")
    local.write_bytes("runs/x/report.html", b"a,b\n1,2\n")  # in the store, but not a run table
    for path in (str(outside), local.url("runs/x/report.html"), "https://example.com/x.csv"):
        with pytest.raises(sql.ReadOnlyError, match=f"^the store is read-only: .*Cannot access file \"{path}\""):
            sql.query(local, f"SELECT * FROM {reader}('{path}')")


def test_the_connection_itself_is_locked(local, tmp_path):
    """Below the statement check: DuckDB refuses other files, extensions and settings on the connection. Not the
    views' own files, which DuckDB reads itself on a local store: its allowed_paths grant writing too (DuckDB has
    no read-only allow-list), so there only the statement check (REFUSED above, test_cli_errors) refuses an
    overwrite in place; test_an_fsspec_root_refuses_writes_to_its_own_files shows the roots where it is locked."""
    con = sql.connect(local)
    settings = dict(con.sql("SELECT name, value FROM duckdb_settings() WHERE name IN ('enable_external_access', "
                            "'lock_configuration', 'autoinstall_known_extensions', 'autoload_known_extensions')"
                            ).fetchall())
    assert settings == {"enable_external_access": "false", "lock_configuration": "true",
                        "autoinstall_known_extensions": "false", "autoload_known_extensions": "false"}
    before = snapshot(tmp_path)
    new_file = local.url("rollouts/run_id=x/step=00000001/part-0.parquet")  # in the store, not one of the views'
    for statement in (f"COPY (SELECT 1) TO '{tmp_path / 'out.csv'}' (FORMAT csv, USE_TMP_FILE false)",
                      f"COPY (SELECT 1 AS score) TO '{new_file}' (USE_TMP_FILE false)",
                      f"ATTACH '{tmp_path / 'other.db'}'", "LOAD httpfs"):
        with pytest.raises(duckdb.PermissionException):
            con.execute(statement)
    with pytest.raises(duckdb.InvalidInputException, match="the configuration has been locked"):
        con.execute("SET enable_external_access = true")
    assert snapshot(tmp_path) == before
    assert con.sql("SELECT count(*) FROM rollouts").fetchone() == (12,)


def test_an_fsspec_root_refuses_writes_to_its_own_files():
    """memory:// (and S3 without httpfs) is read through a read-only filesystem: even the views' own files, which
    DuckDB's settings allow, cannot be written in place on the connection itself."""
    store = ArtifactStore(f"memory://rlpipe-test-{uuid.uuid4().hex[:8]}/store")
    write_scores(store)
    relpath = "rollouts/run_id=run-a/step=00000001/part-0.parquet"
    before = store.read_bytes(relpath)
    con = sql.connect(store)
    with pytest.raises(duckdb.Error, match="the store is read-only for SQL: cannot open .* with mode 'wb'"):
        con.execute(f"COPY (SELECT 42) TO '{store.url(relpath)}' (FORMAT csv, USE_TMP_FILE false)")
    assert store.read_bytes(relpath) == before
    assert con.sql("SELECT count(*) FROM rollouts").fetchone() == (12,)  # reading works as before


def run_cli(store: ArtifactStore, statement: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.sql", "--root", store.root, statement], cwd=PROJECT,
                          capture_output=True, text=True, check=False, timeout=120)


def test_cli_errors(local, tmp_path):
    out = tmp_path / "out.csv"
    table_file = local.url("rollouts/run_id=run-a/step=00000001/part-0.parquet")
    before = snapshot(tmp_path)
    for statement, error in ((f"SELECT 1; COPY (SELECT 1) TO '{out}'", "error: only one SQL statement per query"),
                             (f"COPY (SELECT 1) TO '{out}'", "error: the store is read-only: COPY statements"),
                             (f"COPY (SELECT 42) TO '{table_file}' (FORMAT csv, USE_TMP_FILE false)",
                              "error: the store is read-only: COPY statements"),
                             ("SELECT * FROM read_text('/etc/hostname')", "error: the store is read-only: ")):
        done = run_cli(local, statement)
        assert done.returncode == 1 and done.stdout == ""
        assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith(error), done.stderr
    assert snapshot(tmp_path) == before
