"""Kill a multi-turn (tool-using) RL run with SIGKILL mid-way and rerun the same command: RL resumes from its last
checkpoint, the steps after it are removed from the trajectory tables and redone, and `rollouts` and `turns` hold
every step's samples and every sample's turns exactly once, consistent with each other.

The flow runs in a subprocess in its own session, killed as tests/integration/test_resume.py kills it (SIGKILL to
the whole process group, so Ray's workers and the vLLM engine go too), so it cannot share the test process's Ray
cluster or engines; the config is the smallest that makes the tiny model call the calculator (test_multiturn_flow's
TOOL_TASK: SFT on call conversations only), with 4 RL steps of 4 prompts x 4 samples and a checkpoint every 2
steps, and evaluation on 4 prompts with the hf engine.

Multi-turn sampling is not reproducible: the tool_agent loop's engine calls (and so their seeds) are made of
whatever requests are pending, which depends on tool timing (stages/agent/tool_loop.py). So unlike the
single-turn test, the redone step is not compared with the killed run's values: the checks are on counts and
structure (which samples, which turns, their indices and roles, per-sample counts against the turn rows, the
step metrics against the rows), on the prompts (a pure function of the step), the learning rate, and on the
checkpointed steps' rows, which the resume must leave exactly as the killed run wrote them.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.config import load_config
from infra.sql import query
from infra.store import ArtifactStore
from tests.integration.test_multiturn_flow import TOOL_TASK
from tests.integration.test_resume import check_resumed_run, env

pytestmark = pytest.mark.slow
PROJECT = Path(__file__).resolve().parents[2]
STEPS, BATCH, N, SAVE_FREQ, KILL_AT = 4, 4, 4, 2, 4  # killed in step 4; the last checkpoint is step 2
SAMPLE = "step, group_id, sample_index"


def overrides(tmp_path) -> list[str]:
    return TOOL_TASK + [
        f"storage.root={tmp_path / 'store'}", f"run.output_dir={tmp_path / 'out'}", "tracking.backends=[console]",
        f"rl.total_steps={STEPS}", f"rl.train_batch_size={BATCH}", f"rl.rollout.n={N}", f"rl.save_freq={SAVE_FREQ}",
        "rl.test_freq=0", "rl.val_before_train=false", "rl.max_validation_samples=4", "rl.actor.optim.lr=1e-4",
        "rl.actor.optim.warmup_steps=2", "rl.actor.optim.lr_scheduler=cosine", "ray.num_cpus=2",
        # evaluation is not under test here: few prompts, and the hf engine (no vLLM engine start per model)
        "evaluate.engine=hf", "evaluate.max_samples=4",
    ]


# The first run kills itself and its process group (Ray's workers, the vLLM engine) with SIGKILL at a fixed point:
# in step 4, after its rollouts are written and before its turns are. RL steps take about a second here, so a kill
# from outside on seeing a file (as test_resume does) could land a step later; this one cannot. The killed run
# leaves steps 1-2 checkpointed, step 3 complete in the tables (rollouts, turns, metrics) but not checkpointed, and
# step 4 torn: rollouts without turns.
KILLER = """
import os, runpy, signal, sys
from infra.trajectories import RunTables

write_turns = RunTables.write_turns


def write_turns_or_die(self, step, rows):
    if step == {step}:
        os.killpg(0, signal.SIGKILL)
    write_turns(self, step, rows)


RunTables.write_turns = write_turns_or_die
runpy.run_module("flows.post_train", run_name="__main__", alter_sys=True)
"""


def start(tmp_path, log: Path, args: list[str], kill_at: int | None = None) -> subprocess.Popen:
    """The flow (python -m flows.post_train ARGS) in a new session; `kill_at`: SIGKILL it before step kill_at's turns
    (single-turn steps call write_turns too, with no rows)."""
    command = ["-c", KILLER.format(step=kill_at)] if kill_at else ["-m", "flows.post_train"]
    with log.open("w") as out:  # a file, not a pipe: a pipe nobody reads would block the flow when full
        return subprocess.Popen([sys.executable, *command, *args], cwd=PROJECT, env=env(tmp_path), stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)


def run_to_end(process: subprocess.Popen, timeout: float) -> None:
    try:
        process.wait(timeout=timeout)
    finally:
        kill(process)  # a killed run kills itself; this is for a run that hung


def kill(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def rows(root: str, sql: str) -> list[tuple]:
    return [tuple(r.values()) for r in query(root, sql)]


def killed_run(tmp_path, args: list[str], kill_at: int) -> float:
    """Run the flow until it kills itself in step `kill_at`; -> the time it was dead by."""
    first = start(tmp_path, tmp_path / "first.log", args, kill_at=kill_at)
    run_to_end(first, 900)
    assert first.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-5000:]
    return time.time()


def rerun(tmp_path, args: list[str]) -> tuple[str, int, int]:
    """The same command again, to its end with data prep and SFT cached; -> (its run.log, the step RL resumed at,
    the partial trajectory files it removed)."""
    second = start(tmp_path, tmp_path / "second.log", args)
    run_to_end(second, 900)
    output = (tmp_path / "second.log").read_text()
    assert second.returncode == 0, output[-5000:]
    assert "data-prep cached" in output and "sft cached" in output, output[-3000:]
    run_log = Path(re.search(r"^logs: (\S+/run\.log)", output, re.M).group(1)).read_text()
    resumed = re.search(r"rl: resumed at step (\d+) from \S+ \((\d+) partial trajectory files removed\)", run_log)
    assert resumed, run_log[-3000:]
    return run_log, int(resumed.group(1)), int(resumed.group(2))


def check_flow_went_on(root: str, steps: int) -> list[dict]:
    """After RL: the merged model is the final checkpoint's, and base, SFT and RL are evaluated; -> the evals rows."""
    [merged] = ArtifactStore(root).versions("model", "rl")
    assert merged.metadata["checkpoint_step"] == steps
    evals = query(root, "SELECT label, engine FROM evals WHERE data_source = 'all' AND metric = 'acc' ORDER BY label")
    assert [r["label"] for r in evals] == ["base", "rl", "sft"]
    return evals


def test_sigkill_during_multiturn_rl_then_rerun_resumes(tmp_path):
    root, args = str(tmp_path / "store"), overrides(tmp_path)
    killed_at = killed_run(tmp_path, args, KILL_AT)

    # What the killed run left: steps 1 to 3 in every table (1-2 checkpointed), and step 4's rollouts only.
    assert rows(root, "SELECT DISTINCT step FROM turns ORDER BY 1") == [(s,) for s in range(1, KILL_AT)]
    assert rows(root, "SELECT DISTINCT step FROM metrics ORDER BY 1") == [(s,) for s in range(1, KILL_AT)]
    assert rows(root, "SELECT DISTINCT step FROM rollouts ORDER BY 1") == [(s,) for s in range(1, KILL_AT + 1)]
    kept_sql = {  # the checkpointed steps' rows, which the resume must not touch
        "rollouts": f"SELECT {SAMPLE}, response, reward, num_turns, num_tool_calls, time FROM rollouts "
                    f"WHERE step <= {SAVE_FREQ} ORDER BY ALL",
        "turns": f"SELECT {SAMPLE}, turn, role, text, tool_name, arguments, time FROM turns "
                 f"WHERE step <= {SAVE_FREQ} ORDER BY ALL"}
    kept = {table: rows(root, sql) for table, sql in kept_sql.items()}

    _, step, removed = rerun(tmp_path, args)
    assert (step, removed) == (SAVE_FREQ, 4)  # step 3's rollouts, turns and metrics, step 4's rollouts

    # One run, every step once, every sample once per step, every turn once per sample.
    assert rows(root, "SELECT DISTINCT run_id FROM rollouts") == rows(root, "SELECT DISTINCT run_id FROM turns")
    assert len(rows(root, "SELECT DISTINCT run_id FROM rollouts")) == 1
    counts = query(root, "SELECT step, count(*) AS n, count(DISTINCT group_id) AS groups FROM rollouts "
                         "GROUP BY 1 ORDER BY 1")
    assert counts == [{"step": s, "n": BATCH * N, "groups": BATCH} for s in range(1, STEPS + 1)]
    assert rows(root, f"SELECT {SAMPLE}, count(*) FROM rollouts GROUP BY ALL HAVING count(*) > 1") == []
    assert rows(root, f"SELECT {SAMPLE}, turn, count(*) FROM turns GROUP BY ALL HAVING count(*) > 1") == []
    assert rows(root, "SELECT step, name, count(*) FROM metrics GROUP BY ALL HAVING count(*) > 1") == []
    assert rows(root, "SELECT DISTINCT step FROM metrics ORDER BY 1") == [(s,) for s in range(1, STEPS + 1)]
    metrics = check_turns_match_rollouts(root)

    # The checkpointed steps are the killed run's rows, untouched; the steps after the checkpoint were redone.
    assert {table: rows(root, sql) for table, sql in kept_sql.items()} == kept
    redone = query(root, f"SELECT (SELECT min(time) FROM rollouts WHERE step > {SAVE_FREQ}) AS rollouts, "
                         f"(SELECT min(epoch(time)) FROM turns WHERE step > {SAVE_FREQ}) AS turns")
    assert redone[0]["rollouts"] > killed_at and redone[0]["turns"] > killed_at, (redone, killed_at)

    # As in the single-turn test: the learning rate of an uninterrupted run, each step's prompts, complete
    # artifacts, and the flow goes on from the final checkpoint.
    check_resumed_run(root, load_config(None, args), {step: metrics[step, "actor/lr"] for step in range(1, STEPS + 1)},
                      STEPS, BATCH)
    check_flow_went_on(root, STEPS)


def check_turns_match_rollouts(root: str) -> dict[tuple[int, str], float]:
    """`turns` and `rollouts` describe the same samples, and the step metrics count the same tool calls; -> the
    metrics tool/calls, num_turns/mean and actor/lr by (step, name)."""
    # every row is a tool_agent row: each sample has turns
    assert (rows(root, f"SELECT DISTINCT {SAMPLE} FROM turns ORDER BY ALL")
            == rows(root, f"SELECT {SAMPLE} FROM rollouts ORDER BY ALL"))
    # each sample's turns are that sample's, once each: indices 0..k-1, the model first, its turns' texts joined
    # are the response, their tokens the trained (mask 1) tokens, as many as num_turns, and as many run tool calls
    # (tool turns with a tool name; refused calls have none) as num_tool_calls, with as many errors
    mismatched = rows(root, f"""
        WITH t AS (SELECT {SAMPLE}, count(*) AS n, min(turn) AS lo, max(turn) AS hi,
                          bool_and(role = 'assistant') FILTER (WHERE turn = 0) AS model_first,
                          count(*) FILTER (WHERE role = 'assistant') AS model_turns,
                          string_agg(text, chr(10) ORDER BY turn) FILTER (WHERE role = 'assistant') AS response,
                          sum(num_tokens) FILTER (WHERE role = 'assistant') AS model_tokens,
                          count(*) FILTER (WHERE role = 'tool' AND tool_name IS NOT NULL) AS calls,
                          count(*) FILTER (WHERE role = 'tool' AND tool_name IS NOT NULL AND error) AS errors
                   FROM turns GROUP BY ALL)
        SELECT r.step, r.group_id, r.sample_index FROM rollouts r JOIN t USING (step, group_id, sample_index)
        WHERE t.lo <> 0 OR t.hi <> t.n - 1 OR NOT t.model_first OR t.model_turns <> r.num_turns
           OR t.response <> r.response OR t.model_tokens <> r.num_response_tokens
           OR t.calls <> r.num_tool_calls OR t.errors <> r.num_tool_errors""")
    assert mismatched == [], mismatched[:5]
    # the tool was really called, before and after the resume, and the step metrics count the same calls
    calls = query(root, "SELECT step, sum(num_tool_calls) AS calls, avg(num_turns) AS turns FROM rollouts "
                        "GROUP BY 1 ORDER BY 1")
    assert all(r["calls"] > 0 for r in calls), calls
    [(answered,)] = rows(root, "SELECT count(*) FROM turns WHERE role = 'tool' AND tool_name = 'calculator' "
                               "AND NOT error AND text SIMILAR TO '-?[0-9]+'")
    assert answered > 0  # the calculator computed something
    metrics = {(r["step"], r["name"]): r["value"] for r in query(
        root, "SELECT step, name, value FROM metrics WHERE name IN ('tool/calls', 'num_turns/mean', 'actor/lr')")}
    for r in calls:
        assert metrics[r["step"], "tool/calls"] == r["calls"], r
        assert metrics[r["step"], "num_turns/mean"] == pytest.approx(r["turns"]), r
    return metrics
