"""HTML run report of one RL run: metric plots over steps, evaluation table, best and worst rollouts.

``python -m infra.report --root ROOT --run RUN_ID [--evals-run FLOW_RUN_ID] [--out FILE]`` (without ``--out``
the report is saved in the store as ``runs/<FLOW_RUN_ID or RUN_ID>/report.html`` and its path or URL is printed;
the flow saves it under its own run id, so flows that share an RL run keep their own reports).

Everything comes from the store's run tables (``infra.trajectories``), read with DuckDB through
``infra.sql.read`` on one read-only connection (a file it cannot read is skipped with a warning): ``metrics``
(long format, verl's names such as ``critic/score/mean``, ``actor/ppo_kl``, ``timing_s/gen``), ``validation``,
``rollouts`` and ``evals``.
This module reads them into a ``RunData``; infra/report_render.py renders it: plots embedded as base64 PNG
(one self-contained HTML file, no scripts, no external files), a note instead of a plot the run has no
metrics for, every text from the data escaped.

Why a fixed path (``runs/<run_id>/report.html``, one atomic ``write_bytes``) and not a versioned artifact:
the report is a view over the run's mutable tables; re-rendering it (after a resume, or once evaluation
rows exist) replaces it, and a link published once (the Prefect markdown artifact) stays valid.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import duckdb

from infra.learning_signal import warnings_from_metrics
from infra.report_render import RunData, render
from infra.sql import read
from infra.store import ArtifactStore, StoreError
from infra.trajectories import _check_segment

REPORT_FILE = "report.html"


class UnknownRunError(ValueError):
    """The run id has no rows in the store; the message lists the run ids that do."""


# ---------------------------------------------------------------------------------------------- reading


def _rows(con, sql: str, params: list) -> list[dict]:
    rel = con.execute(sql, params)
    columns = [d[0] for d in rel.description]
    return [dict(zip(columns, row)) for row in rel.fetchall()]


def known_run_ids(con) -> list[str]:
    views = ("metrics", "rollouts", "validation", "evals")
    union = " UNION ".join(f"SELECT DISTINCT run_id FROM {view}" for view in views)
    return sorted(r["run_id"] for r in _rows(con, union, []) if r["run_id"] is not None)


def _columns(con, view: str) -> set[str]:
    return {r["column_name"] for r in _rows(con, f"DESCRIBE {view}", [])}


def _rollout_extremes(con, run_id: str, k: int) -> tuple[list[dict], list[dict]]:
    """k best and k worst rollouts by score; the worst never repeat the best (a run whose scores are all equal).

    Ties: first one sample of each group (step, group_id), so the lists show different prompts where they
    can; then the later step, the larger (best) or smaller (worst) advantage, then the first sample.
    """
    cols = _columns(con, "rollouts")
    if "score" not in cols:
        return [], []
    wanted = ("step", "group_id", "sample_index", "score", "reward", "advantage", "num_response_tokens",
              "finish_reason", "ground_truth", "prompt", "response")
    select = ", ".join(c for c in wanted if c in cols)
    ids = "".join(f", {c}" for c in ("sample_index", "group_id") if c in cols)
    found = []
    grouped = {"step", "group_id"} <= set(cols)
    for order, limit in (("DESC", k), ("ASC", 2 * k)):
        adv = f", advantage {order} NULLS LAST" if "advantage" in cols else ""
        rank = (f"row_number() OVER (PARTITION BY step, group_id ORDER BY score {order}{adv}{ids})" if grouped
                else "1")
        found.append(_rows(con, f"SELECT {select} FROM (SELECT *, {rank} AS _rank FROM rollouts WHERE run_id = ? "
                                f"AND score IS NOT NULL) ORDER BY score {order}, _rank, step DESC{adv}{ids} LIMIT ?",
                           [run_id, limit]))
    best, worst = found
    keys = {tuple(r.get(c) for c in ("step", "group_id", "sample_index")) for r in best}
    worst = [r for r in worst if tuple(r.get(c) for c in ("step", "group_id", "sample_index")) not in keys]
    for row in best + worst[:k]:
        row["turns"] = _turns(con, run_id, row)
    return best, worst[:k]


def _turns(con, run_id: str, row: dict) -> list[dict]:
    """The turns of a multi-turn rollout (role, tool_name, text, error), in order; [] for single-turn ones."""
    if not {"step", "group_id", "sample_index"} <= row.keys():
        return []
    return _rows(con, "SELECT turn, role, tool_name, text, error FROM turns WHERE run_id = ? AND step = ? AND "
                      "group_id = ? AND sample_index = ? ORDER BY turn",
                 [run_id, row["step"], row["group_id"], row["sample_index"]])


def _read_run(con, root: str, run_id: str, evals_run_id: str | None, num_rollouts: int) -> RunData:
    known = known_run_ids(con)
    if run_id not in known:
        raise UnknownRunError(f"run_id={run_id!r} has no rows in the store at {root!r}; known run ids: "
                              f"{', '.join(known) or 'none (the store has no run tables)'}")
    metrics: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in _rows(con, "SELECT step, name, value FROM metrics WHERE run_id = ? ORDER BY step, name", [run_id]):
        metrics[r["name"]].append((int(r["step"]), float(r["value"])))
    val = [] if "score" not in _columns(con, "validation") else _rows(
        con, "SELECT step, avg(score) AS s FROM validation WHERE run_id = ? GROUP BY 1 ORDER BY 1", [run_id])
    best, worst = _rollout_extremes(con, run_id, num_rollouts)
    counts = _rows(con, "SELECT step, count(*) AS n FROM rollouts WHERE run_id = ? GROUP BY 1 ORDER BY 1", [run_id])
    evals = _rows(con, "SELECT * FROM evals WHERE run_id = ?", [evals_run_id or run_id])
    return RunData(run_id, dict(metrics), [(int(r["step"]), float(r["s"])) for r in val], best, worst, evals,
                   sum(r["n"] for r in counts), [int(r["step"]) for r in counts], evals_run_id or run_id,
                   warnings_from_metrics(metrics))


def read_run(store_or_root: ArtifactStore | str, run_id: str, evals_run_id: str | None = None,
             num_rollouts: int = 3) -> RunData:
    """Everything the report needs for run_id; UnknownRunError (listing the known run ids) if it has no rows.

    Through ``infra.sql.read``: a file of the store that DuckDB cannot read (another run's, say) is skipped with
    a warning instead of failing the report."""
    _check_segment("run_id", run_id)
    root = store_or_root.root if isinstance(store_or_root, ArtifactStore) else store_or_root
    return read(store_or_root, lambda con: _read_run(con, root, run_id, evals_run_id, num_rollouts))


class Report(NamedTuple):
    html: str
    warnings: list[str]  # what the page shows in its warning box (infra.learning_signal)


def build_report(store_or_root: ArtifactStore | str, rl_run_id: str, title: str | None = None,
                 extra: dict | None = None, *, evals_run_id: str | None = None, num_rollouts: int = 3) -> Report:
    """The report of rl_run_id (evaluation rows of evals_run_id, default the same run): HTML and its warnings."""
    if num_rollouts < 0:
        raise ValueError(f"num_rollouts={num_rollouts}: expected >= 0 (best and worst rollouts shown)")
    data = read_run(store_or_root, rl_run_id, evals_run_id, num_rollouts)
    return Report(render(data, title or f"RL run report: {rl_run_id}", extra), data.warnings)


def report_path(run_id: str) -> str:
    """Where write_report puts the report of run_id, relative to the store root."""
    return f"runs/{_check_segment('run_id', run_id)}/{REPORT_FILE}"


def write_report(store: ArtifactStore, rl_run_id: str, title: str | None = None, extra: dict | None = None, *,
                 evals_run_id: str | None = None, num_rollouts: int = 3) -> tuple[str, list[str]]:
    """Build the report and save it atomically as runs/<evals_run_id or rl_run_id>/report.html; -> (its path or
    URL, warnings). Under the run whose evaluation it shows: flows that share an RL run (a cache hit) each keep
    their own report."""
    report = build_report(store, rl_run_id, title, extra, evals_run_id=evals_run_id, num_rollouts=num_rollouts)
    path = report_path(evals_run_id or rl_run_id)
    store.write_bytes(path, report.html.encode())
    return store.url(path), report.warnings


# ---------------------------------------------------------------------------------------------- CLI


def write_out(out: Path, data: bytes) -> Path:
    """Write data to the file --out atomically (a temporary file next to it, then a rename; its folder is created):
    a reader never sees half a report. -> the file's absolute path. ValueError naming --out for a folder or a
    file that cannot be written."""
    out = out.expanduser().resolve()
    if out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a folder; give the report's file name, e.g. "
                         f"--out {str(out / REPORT_FILE)!r}")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, out)
    except OSError as exc:
        if tmp.exists():  # written, not renamed
            tmp.unlink()
        raise ValueError(f"--out {str(out)!r}: cannot write the report there ({exc.strerror or exc}); "
                         "give a file path in a folder you can write to") from None
    return out


def main(argv: list[str] | None = None) -> int:
    """python -m infra.report --root ROOT --run RUN_ID [--out FILE]; exit 2 for an unknown run id."""
    from infra.config_sections import StorageConfig

    default = StorageConfig()
    parser = argparse.ArgumentParser(prog="python -m infra.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=default.root, help="store root: local folder or s3://bucket/prefix")
    parser.add_argument("--endpoint-url", default=default.endpoint_url, help="S3 endpoint (or AWS_ENDPOINT_URL)")
    parser.add_argument("--run", required=True, help="RL run id (the run_id partition of the run tables)")
    parser.add_argument("--evals-run", default=None, help="run id of the evaluation rows (default: --run)")
    parser.add_argument("--title", default=None, help="page title (default: 'RL run report: RUN')")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the HTML to this file instead of runs/RUN/report.html in the store")
    args = parser.parse_args(argv)
    store = ArtifactStore(args.root, args.endpoint_url)
    try:
        if args.out is None:
            url, warnings = write_report(store, args.run, args.title, evals_run_id=args.evals_run)
        else:
            report = build_report(store, args.run, args.title, evals_run_id=args.evals_run)
            url, warnings = str(write_out(args.out, report.html.encode())), report.warnings
        for text in warnings:
            print(f"warning: {text}", file=sys.stderr)
        print(url)
    except UnknownRunError as exc:
        print(f"error: {exc}. Fix: pass one of them as --run", file=sys.stderr)
        return 2
    except (StoreError, ValueError, duckdb.Error) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
