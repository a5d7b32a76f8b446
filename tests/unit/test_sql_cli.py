"""The SQL command line on a store where RL has written nothing yet, and its options: every query of the README
answers no rows there (a view without files declares the columns its writer writes, checked against the writers
here), --max-rows takes an integer >= 1, and ``python -m infra.sql_cli`` is the same command as ``python -m
infra.sql``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from infra import sql, sql_cli
from infra.store import ArtifactStore
from infra.trajectories import RunTables
from stages.agent.trajectory import Trajectory
from stages.rl_data import trajectory_rows
from stages.validation import validation_samples
from tests.unit.test_dynamic_sampling import scored
from tests.unit.test_store_cli import run
from tests.unit.test_trajectories import PROJECT, write_scores

# `python -m infra.sql [--option value | a line break]... "SQL"` in the README
_EXAMPLE = re.compile(r'python -m infra\.sql(?: +--[\w-]+ +[^\s"]+| *\\\n)* +"([^"]+)"')


def readme_queries() -> list[str]:
    return [" ".join(found.split()) for found in _EXAMPLE.findall((PROJECT / "README.md").read_text())]


@pytest.fixture
def store(tmp_path) -> ArtifactStore:
    return ArtifactStore(str(tmp_path / "store"), cache_dir=tmp_path / "cache")


def test_the_readme_queries_answer_no_rows_on_a_store_without_rollouts(store, capsys):
    queries = readme_queries()
    assert len(queries) >= 4 and any("avg(score) FROM rollouts" in q for q in queries), queries
    store.check()  # a fresh store; then one as SFT leaves it: metrics only
    for stage in ("fresh", "metrics only"):
        for query in queries:
            code, out, err = run(capsys, sql_cli.main, "--root", store.root, "--format", "json", query)
            assert (code, err, json.loads(out or "null")) == (0, "", []), f"{stage}: {query}"
        RunTables(store, "sft-0").write_metrics(1, {"train/loss": 0.5})


def describe(store: ArtifactStore, table: str) -> dict[str, str]:
    return {row["column_name"]: row["column_type"] for row in sql.query(store, f"DESCRIBE {table}")}


def test_empty_views_declare_the_columns_their_writers_write(tmp_path):
    """The empty rollouts and validation views have the columns and types that RL's rows give them."""
    written = ArtifactStore(str(tmp_path / "written"))
    tables = RunTables(written, "run-a")
    batch = scored([[5, 6], [7]], {"group_id": ["1-0"] * 2, "response": ["a", "b"], "policy_version": [0, 1],
                                   "policy_version_max": [1, 1], "token_versions": [[0, 1], [1]]})  # async columns too
    tables.write_rollouts(1, trajectory_rows(batch, ["p"] * 2, policy_version=1))
    result = SimpleNamespace(scores=[1.0], components={"acc": [1.0]}, preds=["4"])
    rollout = SimpleNamespace(run=lambda prompts, rows, params: [Trajectory(0, [5], [1], [-0.1], "stop", "x = 4")],
                              score=lambda prompts, rows, trajectories: SimpleNamespace(result=result))
    prompts = SimpleNamespace(data_sources=["math"], ground_truths=[4])
    tables.write_validation(1, validation_samples(rollout, prompts, [0], params=None))
    empty = ArtifactStore(str(tmp_path / "empty"))
    for table in ("rollouts", "validation"):
        assert describe(empty, table) == describe(written, table), table
    assert describe(empty, "rollouts")["score"] == "DOUBLE" and describe(empty, "validation")["pred"] == "VARCHAR"


@pytest.mark.parametrize("value", ["0", "-1", "ten"])
def test_max_rows_below_one_is_a_usage_error_naming_it(tmp_path, capsys, value):
    root = str(tmp_path / "store")
    write_scores(ArtifactStore(root))
    with pytest.raises(SystemExit) as exit_:
        sql_cli.main(["--root", root, "--max-rows", value, "SELECT * FROM rollouts"])
    out, err = capsys.readouterr()
    assert (exit_.value.code, out) == (2, "")
    assert f"error: argument --max-rows: {value!r}: expected an integer >= 1" in err, err


def test_max_rows_shows_that_many_rows_and_the_count(tmp_path, capsys):
    root = str(tmp_path / "store")
    write_scores(ArtifactStore(root))  # 12 rollouts
    code, out, err = run(capsys, sql_cli.main, "--root", root, "--max-rows", "1", "SELECT step FROM rollouts")
    assert (code, err) == (0, "") and "12 rows" in out and "(1 shown)" in out, out


def test_python_m_infra_sql_cli_runs_the_command_line(store):
    store.check()
    done = subprocess.run([sys.executable, "-m", "infra.sql_cli", "--root", store.root, "--format", "csv",
                           "SELECT count(*) AS n FROM rollouts"], cwd=PROJECT, capture_output=True, text=True,
                          check=False, timeout=120)
    assert (done.returncode, done.stdout) == (0, "n\n0\n"), done.stderr
