"""One bad parquet file (another run's) must not break SQL over the store: infra.sql leaves it out of its view
with a warning naming it, and every query answers exactly as if the file were not there."""

from __future__ import annotations

import csv
import io
import logging
import subprocess
import sys

import pytest

from infra import report, report_render, sql
from infra.store import ArtifactStore
from infra.trajectories import RunTables
from tests.unit import test_report
from tests.unit.test_trajectories import PROJECT, T0, write_scores

QUERY = "SELECT run_id, step, count(*) AS n, avg(score) AS s FROM rollouts GROUP BY ALL ORDER BY ALL"


def truncated(good: bytes) -> bytes:
    return good[: len(good) // 2]  # a write cut off half way: no footer, no magic bytes at the end


def zero_bytes(good: bytes) -> bytes:
    return b""


def text(good: bytes) -> bytes:
    return b"step,score\n1,0.5\n"  # a CSV saved under the parquet name


def corrupt_footer(good: bytes) -> bytes:
    """Magic bytes and footer length intact, footer overwritten: DuckDB's thrift error names no file."""
    footer = int.from_bytes(good[-8:-4], "little")
    return good[: -8 - footer] + b"\xab" * footer + good[-8:]


BAD = [truncated, zero_bytes, text, corrupt_footer]


def write_bad(store: ArtifactStore, make, table: str = "rollouts", run_id: str = "run-bad") -> str:
    """A bad part-0.parquet in run_id's step 1 of table, made from a good file of that table; -> its URL."""
    good = store.read_bytes(store.glob(f"{table}/run_id=*/step=*/part-0.parquet")[0])
    relpath = f"{table}/run_id={run_id}/step=00000001/part-0.parquet"
    store.write_bytes(relpath, make(good))
    return store.url(relpath)


@pytest.fixture
def local(tmp_path) -> ArtifactStore:
    return ArtifactStore(str(tmp_path / "store"), cache_dir=tmp_path / "cache")


def skipped(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "infra.sql" and r.getMessage().startswith("skipping")]


@pytest.mark.parametrize("make", BAD, ids=lambda make: make.__name__)
def test_a_bad_file_of_another_run_is_skipped_with_a_warning(local, make, caplog):
    write_scores(local)
    expected = sql.query(local, QUERY)
    assert expected[:2] == [{"run_id": "run-a", "step": 1, "n": 2, "s": 0.5},  # (0 + 1) / 2
                            {"run_id": "run-a", "step": 2, "n": 2, "s": 1.0}]
    url = write_bad(local, make)
    with caplog.at_level(logging.WARNING, logger="infra.sql"):
        assert sql.query(local, QUERY) == expected
    [message] = skipped(caplog)
    assert message.startswith(f"skipping {url}: ") and "fix: restore or delete that file" in message


def test_connect_leaves_the_bad_file_out_of_its_view(local, caplog):
    write_scores(local)
    url = write_bad(local, truncated)
    with caplog.at_level(logging.WARNING, logger="infra.sql"):
        con = sql.connect(local)
    assert con.sql("SELECT count(*) FROM rollouts").fetchone() == (12,)  # 2 runs x 3 steps x 2 samples
    assert con.sql("SELECT count(*) FROM rollouts WHERE run_id = 'run-bad'").fetchone() == (0,)
    assert [url in m for m in skipped(caplog)] == [True]


# (column, run-bad's value, its DuckDB type, the good files' type). DuckDB names the file that it fails to cast to
# the union type: the odd one for `time` (the union is TIMESTAMPTZ), a good one for `score` (the union is the odd
# file's STRUCT; a query that needs a number, avg(score), fails in the binder before any file is read).
ODD_TYPES = [("time", 1.5, "DOUBLE", "TIMESTAMP WITH TIME ZONE"), ("score", {"x": 1.0}, "STRUCT(x DOUBLE)", "DOUBLE")]
ROWS = "SELECT run_id, step, sample_index, score, time FROM rollouts ORDER BY 1, 2, 3"


@pytest.mark.parametrize(("column", "value", "odd_type", "good_type"), ODD_TYPES, ids=[c[0] for c in ODD_TYPES])
def test_columns_that_do_not_union_skip_the_odd_file_only(local, caplog, column, value, odd_type, good_type):
    write_scores(local)
    expected = sql.query(local, ROWS)
    assert len(expected) == 12 and expected[1] == \
        {"run_id": "run-a", "step": 1, "sample_index": 1, "score": 1.0, "time": T0}
    RunTables(local, "run-bad").write_rollouts(1, [{"score": 0.5, "time": T0, column: value}])
    url = local.url("rollouts/run_id=run-bad/step=00000001/part-0.parquet")
    with caplog.at_level(logging.WARNING, logger="infra.sql"):
        assert sql.query(local, ROWS) == expected
    [message] = skipped(caplog)
    assert message.startswith(f"skipping {url}: column {column!r} is {odd_type} here and {good_type} in 6 other ")


def test_too_many_bad_files_is_an_error(local, monkeypatch):
    write_scores(local)
    monkeypatch.setattr(sql, "MAX_SKIPPED_FILES", 1)
    write_bad(local, truncated, run_id="run-bad")
    write_bad(local, zero_bytes, run_id="run-worse")
    with pytest.raises(ValueError, match="more than 1 unreadable files"):
        sql.query(local, QUERY)


def test_report_of_a_good_run_survives_a_corrupt_file_of_another_run(local, caplog):
    test_report.write_run(local)
    expected = report.read_run(local, test_report.RUN)
    urls = [write_bad(local, truncated, table) for table in ("rollouts", "metrics")]
    with caplog.at_level(logging.WARNING, logger="infra.sql"):
        assert report.read_run(local, test_report.RUN) == expected
        page = report.build_report(local, test_report.RUN).html
    assert len(test_report.images(page)) == len(report_render.PANELS)
    assert all(any(url in m for m in skipped(caplog)) for url in urls)


def test_cli_answers_and_names_the_bad_file(local):
    tables = RunTables(local, "run-a")
    for step in (1, 2):
        tables.write_metrics(step, {"actor/pg_loss": 0.5, "critic/score/mean": 0.25})
    url = write_bad(local, truncated, "metrics")
    command = [sys.executable, "-m", "infra.sql", "--root", local.root, "--format", "csv",
               "SELECT count(*) AS n FROM metrics"]
    done = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    assert list(csv.DictReader(io.StringIO(done.stdout))) == [{"n": "4"}]  # 2 steps x 2 metrics of run-a
    assert f"skipping {url}: " in done.stderr
