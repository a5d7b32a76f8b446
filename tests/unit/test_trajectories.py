"""Run tables (infra.trajectories) on a local store, read back through DuckDB (infra.sql): hand-computed
aggregates, replace-on-rewrite, truncation on resume, schema drift across runs, empty views and the CLI."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest

from infra import sql
from infra.store import ArtifactStore
from infra.trajectories import RunTables

PROJECT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)

# run -> step -> scores of that step's samples (2 samples per step)
SCORES = {"run-a": {1: [0.0, 1.0], 2: [1.0, 1.0], 3: [0.5, 0.0]},
          "run-b": {1: [1.0, 0.0], 2: [0.0, 0.0], 3: [1.0, 1.0]}}


def rollout_rows(step: int, scores: list[float], **extra) -> list[dict]:
    return [{"group_id": f"g{step}", "sample_index": i, "data_source": "synthetic", "prompt": "1+1=",
             "response": "2", "ground_truth": "2", "num_prompt_tokens": 4, "num_response_tokens": 1,
             "score": score, "reward": score, "advantage": 0.0, "old_logprob_mean": -0.5, "ref_logprob_mean": None,
             "finish_reason": "stop", "policy_version": step - 1, "time": T0, **extra}
            for i, score in enumerate(scores)]


def write_scores(store: ArtifactStore, scores: dict = SCORES) -> None:
    for run_id, steps in scores.items():
        tables = RunTables(store, run_id)
        for step, values in steps.items():
            tables.write_rollouts(step, rollout_rows(step, values))


def write_all_tables(tables: RunTables, steps: range) -> None:
    for step in steps:
        tables.write_rollouts(step, rollout_rows(step, [1.0]))
        tables.write_metrics(step, {"actor/pg_loss": 0.1 * step})
        tables.write_validation(step, [{"score": 1.0, "prompt": "p"}])
        tables.write_turns(step, [{"group_id": f"{step}-0", "sample_index": 0, "turn": 0, "role": "assistant",
                                   "text": "call", "num_tokens": 3}])


@pytest.fixture
def local(tmp_path) -> ArtifactStore:
    return ArtifactStore(str(tmp_path / "store"), cache_dir=tmp_path / "cache")


def test_avg_score_per_step_across_two_runs(local):
    write_scores(local)
    got = sql.query(local, "SELECT step, avg(score) AS s, count(*) AS n FROM rollouts GROUP BY 1 ORDER BY 1")
    # step 1: (0 + 1 + 1 + 0) / 4 = 0.5; step 2: (1 + 1 + 0 + 0) / 4 = 0.5; step 3: (0.5 + 0 + 1 + 1) / 4 = 0.625
    assert got == [{"step": 1, "s": 0.5, "n": 4}, {"step": 2, "s": 0.5, "n": 4}, {"step": 3, "s": 0.625, "n": 4}]
    per_run = sql.query(local, "SELECT run_id, avg(score) AS s FROM rollouts GROUP BY 1 ORDER BY 1")
    # run-a: (0 + 1 + 1 + 1 + 0.5 + 0) / 6 = 3.5 / 6; run-b: (1 + 0 + 0 + 0 + 1 + 1) / 6 = 0.5
    assert per_run == [{"run_id": "run-a", "s": pytest.approx(3.5 / 6, abs=1e-12)}, {"run_id": "run-b", "s": 0.5}]


def test_partition_columns_are_typed_and_first(local):
    write_scores(local)
    RunTables(local, "run-a").write_evals("100", [{"accuracy": 0.25}])
    con = sql.connect(local)
    types = dict(con.sql("SELECT column_name, column_type FROM (DESCRIBE rollouts)").fetchall())
    assert list(types)[:2] == ["run_id", "step"]
    assert types["run_id"] == "VARCHAR" and types["step"] == "BIGINT"  # step=00000001 -> 1, not '00000001'
    assert types["ref_logprob_mean"] == "DOUBLE"  # all-None column written as float64
    assert types["time"] == "TIMESTAMP WITH TIME ZONE" and types["sample_index"] == "BIGINT"
    assert con.sql("SELECT label, accuracy FROM evals").fetchall() == [("100", 0.25)]  # label stays text
    assert con.sql("SELECT DISTINCT time FROM rollouts").fetchall() == [(T0,)]


def test_rewriting_a_step_replaces_it(local):
    write_scores(local)
    before = sql.query(local, "SELECT count(*) AS n FROM rollouts")[0]["n"]
    RunTables(local, "run-a").write_rollouts(2, rollout_rows(2, [0.25, 0.75]))  # redo of step 2 after a resume
    assert sql.query(local, "SELECT count(*) AS n FROM rollouts")[0]["n"] == before == 12
    got = sql.query(local, "SELECT score FROM rollouts WHERE run_id = 'run-a' AND step = 2 ORDER BY sample_index")
    assert [r["score"] for r in got] == [0.25, 0.75]
    # step 2 over both runs: (0.25 + 0.75 + 0 + 0) / 4 = 0.25
    assert sql.query(local, "SELECT avg(score) AS s FROM rollouts WHERE step = 2") == [{"s": 0.25}]
    assert len(local.glob("rollouts/run_id=run-a/step=00000002/*")) == 1  # one file, no temp leftovers


def test_truncate_after_removes_later_steps_of_that_run_only(local):
    a, b = RunTables(local, "run-a"), RunTables(local, "run-b")
    write_all_tables(a, range(1, 4))
    write_all_tables(b, range(1, 4))
    a.write_evals("final", [{"accuracy": 1.0}])
    assert a.truncate_after(1) == 8  # steps 2, 3 x (rollouts, metrics, validation, turns)
    for table in ("rollouts", "metrics", "validation", "turns"):
        assert a.steps(table) == [1] and b.steps(table) == [1, 2, 3]
        got = sql.query(local, f"SELECT run_id, max(step) AS last FROM {table} GROUP BY 1 ORDER BY 1")
        assert got == [{"run_id": "run-a", "last": 1}, {"run_id": "run-b", "last": 3}]
    assert a.labels() == ["final"]  # evals are keyed by label, not step: kept
    assert a.truncate_after(1) == 0
    write_all_tables(a, range(2, 3))  # the resumed run regenerates step 2
    assert a.steps("rollouts") == [1, 2]


def test_union_by_name_across_runs_with_different_reward_columns(local):
    RunTables(local, "run-a").write_rollouts(1, rollout_rows(1, [1.0], reward_format=0.5))
    RunTables(local, "run-b").write_rollouts(1, rollout_rows(1, [0.0], reward_length=-0.25))
    got = sql.query(local, "SELECT run_id, reward_format, reward_length FROM rollouts ORDER BY run_id")
    assert got == [{"run_id": "run-a", "reward_format": 0.5, "reward_length": None},
                   {"run_id": "run-b", "reward_format": None, "reward_length": -0.25}]


def test_metrics_are_long_format(local):
    tables = RunTables(local, "run-a")
    tables.write_metrics(1, {"actor/pg_loss": 0.5, "critic/score/mean": 2})  # int -> float
    tables.write_metrics(2, {"actor/pg_loss": 0.25, "critic/score/mean": 3.0})
    got = sql.query(local, "SELECT step, name, value FROM metrics ORDER BY step, name")
    assert got == [{"step": 1, "name": "actor/pg_loss", "value": 0.5},
                   {"step": 1, "name": "critic/score/mean", "value": 2.0},
                   {"step": 2, "name": "actor/pg_loss", "value": 0.25},
                   {"step": 2, "name": "critic/score/mean", "value": 3.0}]
    wide = sql.query(local, "SELECT step, max(value) FILTER (name = 'actor/pg_loss') AS loss FROM metrics "
                            "GROUP BY 1 ORDER BY 1")
    assert wide == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]
    with pytest.raises(ValueError, match="actor/kl"):
        tables.write_metrics(3, {"actor/kl": "high"})


def test_empty_store_gives_empty_views(local):
    for table, key in (("rollouts", "step"), ("metrics", "step"), ("validation", "step"), ("evals", "label")):
        assert sql.query(local, f"SELECT count(*) AS n FROM {table}") == [{"n": 0}]
        assert sql.query(local, f"SELECT run_id, {key} FROM {table}") == []
    assert sql.query(local, "SELECT count(*) AS n FROM metrics WHERE name = 'x' AND value > 0") == [{"n": 0}]
    RunTables(local, "run-a").write_metrics(1, {"x": 1.0})  # one table with files, the others still empty
    assert sql.query(local, "SELECT (SELECT count(*) FROM metrics) AS m, (SELECT count(*) FROM rollouts) AS r") == \
        [{"m": 1, "r": 0}]


def test_empty_rows_remove_the_step(local):
    tables = RunTables(local, "run-a")
    tables.write_validation(4, [{"score": 1.0}])
    tables.write_validation(4, [])  # the redo produced nothing: no stale rows may survive
    assert tables.steps("validation") == []
    assert sql.query(local, "SELECT count(*) AS n FROM validation") == [{"n": 0}]


@pytest.mark.parametrize("call, match", [
    (lambda t: t.write_rollouts(1, [{"step": 1, "score": 1.0}]), "partition path"),
    (lambda t: t.write_rollouts(-1, [{"score": 1.0}]), "step=-1"),
    (lambda t: t.write_rollouts(1, [{"score": 1.0}, {"score": "high"}]), "column 'score'"),
    (lambda t: t.write_rollouts(1, ["not a dict"]), "dicts"),
    (lambda t: t.write_evals("final/x", [{"a": 1}]), "label='final/x'"),
    (lambda t: t.steps("evals"), "labels"),
])
def test_bad_input_is_rejected(local, call, match):
    with pytest.raises(ValueError, match=match):
        call(RunTables(local, "run-a"))
    with pytest.raises(ValueError, match="run_id='../x'"):
        RunTables(local, "../x")


def test_fsspec_root_is_read_through_a_registered_filesystem():
    """memory:// has no DuckDB extension: connect() registers the store's fsspec filesystem instead."""
    store = ArtifactStore(f"memory://rlpipe-test-{uuid.uuid4().hex[:8]}/store")
    write_scores(store)
    assert sql.query(store, "SELECT step, avg(score) AS s FROM rollouts GROUP BY 1 ORDER BY 1") == \
        [{"step": 1, "s": 0.5}, {"step": 2, "s": 0.5}, {"step": 3, "s": 0.625}]


def test_s3_secret_options_from_endpoint_and_env():
    env = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "eu-west-1"}
    assert sql.s3_secret_options("http://127.0.0.1:9000", env) == {
        "REGION": "eu-west-1", "KEY_ID": "k", "SECRET": "s", "ENDPOINT": "127.0.0.1:9000", "URL_STYLE": "path",
        "USE_SSL": False}
    assert sql.s3_secret_options("https://minio.example.com/", env)["USE_SSL"] is True
    assert sql.s3_secret_options(None, {}) == {"REGION": "us-east-1"}  # AWS itself, anonymous
    with pytest.raises(ValueError, match="endpoint_url='ftp://x'"):
        sql.s3_secret_options("ftp://x", env)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.sql", *args], cwd=PROJECT, capture_output=True, text=True,
                          timeout=120)


def test_cli_csv_json_and_errors(local):
    write_scores(local)
    query = "SELECT step, avg(score) AS s FROM rollouts GROUP BY 1 ORDER BY 1"
    done = run_cli("--root", local.root, "--format", "csv", query)
    assert done.returncode == 0, done.stderr
    assert list(csv.DictReader(io.StringIO(done.stdout))) == \
        [{"step": "1", "s": "0.5"}, {"step": "2", "s": "0.5"}, {"step": "3", "s": "0.625"}]

    done = run_cli("--root", local.root, "--format", "json", "SELECT run_id, step, time FROM rollouts "
                   "WHERE sample_index = 0 ORDER BY run_id, step LIMIT 2")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [{"run_id": "run-a", "step": 1, "time": T0.isoformat()},
                                       {"run_id": "run-a", "step": 2, "time": T0.isoformat()}]

    done = run_cli("--root", local.root, "SELECT count(*) AS num_rows FROM rollouts")  # default: table
    assert done.returncode == 0 and "num_rows" in done.stdout and "12" in done.stdout

    done = run_cli("--root", local.root, "SELECT no_such_column FROM rollouts")
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no_such_column" in lines[0]


def test_single_turn_runs_write_no_turns_and_the_view_is_empty_but_typed(local):
    tables = RunTables(local, "run-a")
    tables.write_rollouts(1, rollout_rows(1, [1.0]))
    tables.write_turns(1, [])
    assert local.glob("turns/**") == []
    assert sql.query(local, "SELECT count(*) AS n FROM turns") == [{"n": 0}]
    columns = {r["column_name"]: r["column_type"] for r in sql.query(local, "DESCRIBE turns")}
    assert columns["role"] == "VARCHAR" and columns["turn"] == "BIGINT" and columns["step"] == "BIGINT"


def test_a_redone_step_without_turns_removes_the_earlier_attempts_turns(local):
    tables = RunTables(local, "run-a")
    tables.write_turns(2, [{"group_id": "2-0", "sample_index": 0, "turn": 0, "role": "assistant", "text": "x"}])
    tables.write_turns(2, [])
    assert sql.query(local, "SELECT count(*) AS n FROM turns") == [{"n": 0}]


def test_turn_columns_keep_their_types_when_a_step_has_only_nones(local):
    tables = RunTables(local, "run-a")
    tables.write_turns(1, [{"group_id": "1-0", "sample_index": 0, "turn": 1, "role": "tool", "text": "error: bad json",
                            "tool_name": None, "arguments": None, "error": True, "latency_s": 0.0}])
    assert sql.query(local, "SELECT count(*) AS n FROM turns WHERE tool_name = 'calculator'") == [{"n": 0}]
    columns = {r["column_name"]: r["column_type"] for r in sql.query(local, "DESCRIBE turns")}
    assert columns["tool_name"] == columns["arguments"] == "VARCHAR" and columns["error"] == "BOOLEAN"
