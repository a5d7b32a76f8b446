"""Run tables on a real local S3 server (moto), queried through infra.sql with DuckDB's httpfs (and the s3fs
fallback): the same answers as the same tables in a local folder, from the Python API and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra import sql
from infra.store import ArtifactStore
from infra.trajectories import RunTables
from tests.unit.test_trajectories import SCORES, rollout_rows, write_all_tables, write_scores

pytestmark = pytest.mark.s3

PROJECT = Path(__file__).resolve().parents[2]
QUERIES = [
    "SELECT step, avg(score) AS s, count(*) AS n FROM rollouts GROUP BY 1 ORDER BY 1",
    "SELECT run_id, step, sample_index, score, reward_format, reward_length FROM rollouts ORDER BY 1, 2, 3",
    "SELECT run_id, step, name, value FROM metrics ORDER BY 1, 2, 3",
    "SELECT run_id, step, count(*) AS n FROM validation GROUP BY 1, 2 ORDER BY 1, 2",
    "SELECT run_id, label, accuracy FROM evals ORDER BY 1, 2",
    "SELECT column_name, column_type FROM (DESCRIBE rollouts) ORDER BY 1",
]


def fill(store: ArtifactStore) -> None:
    """Two runs (different reward_* columns), every table; run-a redoes step 2 and is truncated after step 2."""
    write_scores(store)
    a, b = RunTables(store, "run-a"), RunTables(store, "run-b")
    a.write_rollouts(1, rollout_rows(1, SCORES["run-a"][1], reward_format=0.5))
    b.write_rollouts(1, rollout_rows(1, SCORES["run-b"][1], reward_length=-0.25))
    write_all_tables(a, range(4, 6))
    a.write_rollouts(2, rollout_rows(2, [0.25, 0.75]))  # replaces step 2
    assert a.truncate_after(4) == 4  # step 5 of rollouts, metrics, validation, turns
    b.write_metrics(1, {"actor/pg_loss": 1.5, "critic/score/mean": 0.5})
    a.write_evals("final", [{"accuracy": 0.75}])
    b.write_evals("100", [{"accuracy": 0.5}])


@pytest.fixture
def s3_store(s3_server, tmp_path) -> ArtifactStore:
    bucket = s3_server.create_bucket()
    return ArtifactStore(f"s3://{bucket}/prefix", endpoint_url=s3_server.endpoint_url, cache_dir=tmp_path / "cache")


@pytest.fixture
def expected(tmp_path) -> list[list[dict]]:
    """The answers of QUERIES over the same tables in a local folder."""
    local = ArtifactStore(str(tmp_path / "local"), cache_dir=tmp_path / "cache")
    fill(local)
    return [sql.query(local, q) for q in QUERIES]


def test_python_api_on_s3_matches_local(s3_store, expected):
    fill(s3_store)
    assert [sql.query(s3_store, q) for q in QUERIES] == expected
    assert expected[0] == [{"step": 1, "s": 0.5, "n": 4}, {"step": 2, "s": 0.25, "n": 4},  # (0.25+0.75+0+0)/4
                           {"step": 3, "s": 0.625, "n": 4}, {"step": 4, "s": 1.0, "n": 1}]
    assert RunTables(s3_store, "run-a").steps("rollouts") == [1, 2, 3, 4]
    assert sql.query(s3_store.root, "SELECT count(*) AS n FROM rollouts", s3_store.endpoint_url) == [{"n": 13}]


SECRET = "not-to-be-printed-3f9a"  # moto does not check signatures: any secret key works


def test_s3_is_read_by_httpfs_with_a_redacted_secret(s3_store, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    fill(s3_store)
    con = sql.connect(s3_store)
    # httpfs reads S3 (an s3 secret exists only with it), not a registered fsspec filesystem; duckdb_extensions()
    # itself is refused on the locked connection (it scans the extension folder)
    assert "S3FileSystem" in con.list_filesystems() and "s3" not in con.list_filesystems()
    secret = con.sql("SELECT secret_string FROM duckdb_secrets()").fetchone()[0]
    assert "secret=redacted" in secret and SECRET not in secret
    assert "url_style=path" in secret and "use_ssl=false" in secret
    assert con.sql("SELECT count(*) FROM rollouts").fetchone() == (13,)


def test_s3fs_fallback_without_the_extension(s3_store, expected, monkeypatch):
    fill(s3_store)
    monkeypatch.setattr(sql, "_httpfs_file", lambda con: None)  # as if no httpfs was built for this DuckDB
    con = sql.connect(s3_store)
    assert "s3" in con.list_filesystems() and "S3FileSystem" not in con.list_filesystems()  # fsspec's s3fs
    got = [[dict(zip(rel.columns, row)) for row in rel.fetchall()] for rel in map(con.sql, QUERIES)]
    assert got == expected


def test_empty_s3_store_gives_empty_views(s3_store):
    assert sql.query(s3_store, "SELECT (SELECT count(*) FROM rollouts) + (SELECT count(*) FROM evals) AS n") == \
        [{"n": 0}]


def run_cli(store: ArtifactStore, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.sql", "--root", store.root, "--endpoint-url",
                           store.endpoint_url, *args], cwd=PROJECT, capture_output=True, text=True, timeout=120,
                          env=os.environ)  # the fixture's fake AWS credentials


def test_cli_on_s3_matches_local(s3_store, expected, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    fill(s3_store)
    for q, want in list(zip(QUERIES, expected))[::2]:  # a subprocess each: a few suffice
        done = run_cli(s3_store, "--format", "json", q)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == want
    done = run_cli(s3_store, "SELECT * FROM no_such_table")
    assert done.returncode == 1 and done.stderr.startswith("error: ") and "no_such_table" in done.stderr
    assert SECRET not in done.stdout + done.stderr


def test_cli_on_a_missing_bucket_fails_with_one_error_line(s3_server):
    store = ArtifactStore("s3://no-such-bucket-rlpipe/prefix", endpoint_url=s3_server.endpoint_url)
    done = run_cli(store, "SELECT count(*) FROM rollouts")
    assert done.returncode == 2, done.stdout  # bad input: a root that holds no store
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith(
        f"error: there is no store at storage.root={store.root!r}"), done.stderr
    assert "there is no bucket 'no-such-bucket-rlpipe'" in done.stderr
