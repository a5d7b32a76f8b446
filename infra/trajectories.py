"""Append-only per-step parquet tables of one RL run in the artifact store, for SQL with ``python -m infra.sql``.

Layout (hive partitioning: ``run_id`` and ``step``/``label`` come from the path, never from inside the file)::

    {table}/run_id={run_id}/step={step:08d}/part-0.parquet    table in rollouts, metrics, validation, turns
    evals/run_id={run_id}/label={label}/part-0.parquet         evaluation results of a model, keyed by label

One file per (table, run, step). Writing the same (table, run, step) again replaces that file with one atomic
``store.write_bytes``, so a step redone after a crash/resume never leaves duplicate rows; ``truncate_after``
removes the steps after the last checkpoint when a run resumes.

Rows are dicts of plain Python values. Columns are the union of the rows' keys (a key missing from a row is
null), types are inferred by pyarrow, and a column that is entirely None is written as float64 (the
all-None columns of a run are logprob/KL statistics, and DuckDB's ``union_by_name`` widens float64 to
whatever another step holds). Every row gets a ``time`` column (UTC, the write time) unless it has one.
"""

from __future__ import annotations

import logging
import re
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq

from infra import lease
from infra.store import ArtifactStore

logger = logging.getLogger(__name__)

STEP_TABLES = ("rollouts", "metrics", "validation", "turns")
# One row per turn of a multi-turn sample (stages/rl_data.py `turn_rows`); also the columns of an empty `turns`
# view, so that queries over single-turn runs return no rows instead of failing on a missing column.
# `score`: a simulated user's turn score (role user; stages/agent/interactions.py), NULL on other turns.
TURN_COLUMNS = {"group_id": "VARCHAR", "sample_index": "BIGINT", "turn": "BIGINT", "role": "VARCHAR",
                "text": "VARCHAR", "num_tokens": "BIGINT", "tool_name": "VARCHAR", "arguments": "VARCHAR",
                "error": "BOOLEAN", "timeout": "BOOLEAN", "latency_s": "DOUBLE", "score": "DOUBLE",
                "time": "TIMESTAMPTZ"}
# The pipeline's evaluation rows (stages/evaluate.py `eval_rows`: one per model label x data_source x metric) and
# their DuckDB types; also the columns of an empty `evals` view, so that a query over a store without
# evaluations returns no rows instead of failing on a missing column.
EVAL_COLUMNS = {"model": "VARCHAR", "eval": "VARCHAR", "dataset": "VARCHAR", "split": "VARCHAR", "engine": "VARCHAR",
                "data_source": "VARCHAR", "metric": "VARCHAR", "value": "DOUBLE", "num_prompts": "BIGINT",
                "time": "TIMESTAMPTZ"}
TABLES = (*STEP_TABLES, "evals")
PART = "part-0.parquet"
PARTITION_COLUMNS = ("run_id", "step", "label")
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _check_segment(field: str, value: str) -> str:
    if not isinstance(value, str) or not _SEGMENT.match(value):
        raise ValueError(f"{field}={value!r}: use letters, digits, '.', '_', '-' (starting with a letter or "
                         "digit), e.g. 'grpo-qwen-0' or 'step-100'; it becomes a folder name in the store")
    return value


def partition_dir(table: str, run_id: str, step: int | None = None, label: str | None = None) -> str:
    """Relative folder of one partition: 'rollouts/run_id=r/step=00000003' or 'evals/run_id=r/label=final'."""
    if table not in TABLES:
        raise ValueError(f"table={table!r}: expected one of {', '.join(TABLES)}")
    if (table == "evals") != (label is not None) or (step is None) == (label is None):
        raise ValueError(f"table={table!r}: evals take a label, the other tables a step "
                         f"(got step={step!r}, label={label!r})")
    if label is not None:
        return f"{table}/run_id={_check_segment('run_id', run_id)}/label={_check_segment('label', label)}"
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: expected an integer >= 0 (the training step)")
    return f"{table}/run_id={_check_segment('run_id', run_id)}/step={step:08d}"


ARROW_TYPES = {"VARCHAR": pa.string(), "BIGINT": pa.int64(), "DOUBLE": pa.float64(), "BOOLEAN": pa.bool_()}


def rows_to_table(rows: list[dict], now: datetime, types: dict[str, str] | None = None) -> pa.Table:
    """Rows (dicts of plain values) -> a pyarrow table; keys = union over rows; all-None -> float64 unless `types`
    (column -> DuckDB type name) declares the column's type; +time."""
    if not all(isinstance(row, dict) for row in rows):
        bad = next(row for row in rows if not isinstance(row, dict))
        raise ValueError(f"rows must be dicts of plain values; got a {type(bad).__name__}: {bad!r:.200}")
    names = list(dict.fromkeys(key for row in rows for key in row))
    for name in names:
        if not isinstance(name, str) or name in PARTITION_COLUMNS:
            raise ValueError(f"column {name!r}: column names must be strings other than {PARTITION_COLUMNS} "
                             "(those come from the partition path); drop or rename it")
    columns = {}
    for name in names:
        try:
            column = pa.array([row.get(name) for row in rows], type=ARROW_TYPES.get((types or {}).get(name)))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ValueError(f"column {name!r}: cannot build one parquet column from its values ({exc}); "
                             "give every row the same plain type (int, float, str, bool, datetime)") from exc
        columns[name] = column.cast(pa.float64()) if pa.types.is_null(column.type) else column
    if "time" not in columns:
        columns["time"] = pa.array([now] * len(rows), type=pa.timestamp("us", tz="UTC"))
    return pa.table(columns)


def to_parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


class RunTables:
    """The per-step tables of one run (rollouts, metrics, validation, turns) and its evals, in the store."""

    def __init__(self, store: ArtifactStore, run_id: str):
        self.store = store
        self.run_id = _check_segment("run_id", run_id)

    def __repr__(self) -> str:
        return f"RunTables(store={self.store!r}, run_id={self.run_id!r})"

    def write_rollouts(self, step: int, rows: list[dict]) -> None:
        """One row per sample (group_id, sample_index, prompt, response, score, reward, reward_<name>, ...)."""
        self._write(partition_dir("rollouts", self.run_id, step=step), rows)

    def write_turns(self, step: int, rows: list[dict]) -> None:
        """One row per turn of each multi-turn sample (TURN_COLUMNS); no file for single-turn steps (an earlier
        attempt's file of a redone step is removed, as for the other tables)."""
        lease.check(self.run_id)
        folder = partition_dir("turns", self.run_id, step=step)
        if rows:  # typed: a step whose tool_name or arguments are all None must not make them DOUBLE
            self._write(folder, rows, TURN_COLUMNS)
        elif self.store.glob(f"{folder}/{PART}"):
            self.store.delete_table_file(f"{folder}/{PART}")

    def write_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Long format: one row (name, value, time) per metric."""
        now = datetime.now(timezone.utc)
        rows = []
        for name, value in metrics.items():
            try:
                rows.append({"name": str(name), "value": float(value), "time": now})
            except (TypeError, ValueError) as exc:
                raise ValueError(f"metric {name!r}={value!r} at step {step}: expected a number ({exc})") from exc
        self._write(partition_dir("metrics", self.run_id, step=step), rows)

    def write_validation(self, step: int, rows: list[dict]) -> None:
        """One row per validation sample."""
        self._write(partition_dir("validation", self.run_id, step=step), rows)

    def write_evals(self, label: str, rows: list[dict]) -> None:
        """Evaluation results of a model, keyed by label (e.g. 'base', 'rl', 'step-100') instead of a step.

        The pipeline writes `EVAL_COLUMNS` rows under the flow run's id; other columns are allowed too."""
        self._write(partition_dir("evals", self.run_id, label=label), rows)

    def steps(self, table: str) -> list[int]:
        """Sorted steps of this run present in table (one of rollouts, metrics, validation, turns)."""
        if table not in STEP_TABLES:
            raise ValueError(f"table={table!r}: steps exist for {', '.join(STEP_TABLES)}; evals have labels()")
        found = self.store.glob(f"{table}/run_id={self.run_id}/step=*/{PART}")
        return sorted(int(path.split("/")[-2].removeprefix("step=")) for path in found)

    def labels(self) -> list[str]:
        """Sorted eval labels of this run."""
        found = self.store.glob(f"evals/run_id={self.run_id}/label=*/{PART}")
        return sorted(path.split("/")[-2].removeprefix("label=") for path in found)

    def truncate_after(self, step: int) -> int:
        """Delete this run's partitions with step > `step` in rollouts, metrics, validation and turns; -> files
        removed.

        Used on resume: the steps after the last checkpoint will be regenerated. Evals (keyed by label, not
        step) and other runs are left alone.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step={step!r}: expected an integer (the last checkpointed step)")
        lease.check(self.run_id)
        relpaths = [f"{partition_dir(table, self.run_id, step=s)}/{PART}"
                    for table in STEP_TABLES for s in self.steps(table) if s > step]
        if relpaths:
            self.store.delete_table_files(relpaths)
            logger.info("run %s: removed %d table partitions after step %d", self.run_id, len(relpaths), step)
        return len(relpaths)

    def _write(self, folder: str, rows: list[dict], types: dict[str, str] | None = None) -> None:
        lease.check(self.run_id)
        relpath = f"{folder}/{PART}"
        if not rows:
            # A parquet file needs columns; "no rows" for this step = no file, replacing any earlier one.
            existed = bool(self.store.glob(relpath))
            if existed:
                self.store.delete_table_file(relpath)
            logger.warning("%s: no rows to write%s", relpath, "; removed the earlier file" if existed else "")
            return
        self.store.write_bytes(relpath, to_parquet_bytes(rows_to_table(rows, datetime.now(timezone.utc), types)))
