"""The quiet console (infra/console.py): which log records reach it, where the rest goes, and the Ray worker
hook's redirection of a process's output (run in a subprocess, as Ray runs it in a worker)."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.console import LINES, WORKER_LOG_ENV, QuietFilter, RunConsole, format_error

PROJECT = Path(__file__).resolve().parents[2]


def record(name: str, level: int, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc else None
    return logging.LogRecord(name, level, __file__, 1, "message", None, exc_info)


@pytest.mark.parametrize("name, level, shown", [
    ("stages.rl", logging.WARNING, True),  # our warnings
    ("infra.tracking", logging.INFO, False),  # our INFO lines (metrics): run.log only
    ("prefect.task_runs", logging.WARNING, True),  # a task's get_run_logger().warning
    ("prefect.task_runs", logging.INFO, False),  # "Finished in state Completed()"
    ("ray", logging.WARNING, False),  # library warnings: run.log only
    ("py.warnings", logging.WARNING, False),
    ("vllm", logging.ERROR, True),  # anyone's errors
])
def test_quiet_filter_shows_errors_and_our_warnings(name, level, shown):
    assert QuietFilter().filter(record(name, level)) is shown


def test_a_retried_attempt_is_shown():
    retry = logging.LogRecord("prefect.task_runs", logging.INFO, __file__, 1, "Task run failed with exception: %r - "
                              "Retry 1/1 will start immediately", (ValueError("bad batch"),), None)
    assert QuietFilter().filter(retry)


def test_prefects_reports_of_a_failure_stay_off_the_console(monkeypatch):
    """The flow prints the error that ends a run itself (RunConsole.failed); Prefect's reports of it go to run.log."""
    error = ValueError("bad batch")
    monkeypatch.setattr(QuietFilter, "shown", error)
    finished = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "Finished in state Failed('Task "
                                 "run encountered an exception ValueError: bad batch')", None, None)
    failed = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "Task run failed with exception: %r - "
                               "Retries are exhausted", (error,), (ValueError, error, None))  # with its traceback
    quiet = QuietFilter()
    assert not quiet.filter(finished) and not quiet.filter(failed)
    assert not quiet.filter(record("prefect.flow_runs", logging.ERROR, error))  # 'Encountered exception ...'
    assert quiet.filter(record("prefect.flow_runs", logging.ERROR, KeyError("another")))  # not printed by the flow
    assert quiet.filter(record("prefect.flow_runs", logging.ERROR))  # no exception at all


@pytest.fixture
def terminal(capsys, caplog):
    """The root logger's console handler (Prefect's, in a flow run) on this test's captured stderr; our loggers
    at INFO (as infra.prefect_env sets them)."""
    caplog.set_level(logging.INFO, logger="stages")
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(handler)
    yield
    logging.getLogger().removeHandler(handler)


@pytest.fixture
def chatty_library(terminal):
    """A library logger that prints on its own (its own stderr handler, no propagation), like Ray's or transformers'."""
    logger = logging.getLogger("chatty_library")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    logger.propagate, logger.level = False, logging.INFO
    yield logger
    logger.removeHandler(handler)


def test_quiet_run_console_sorts_records_and_undoes_everything(tmp_path, capsys, chatty_library):
    with RunConsole(tmp_path, "quiet") as console:
        console.line("sft           started")
        chatty_library.info("engine configuration dump")
        chatty_library.warning("library warning")
        logging.getLogger("stages.sft").info("step 10 loss=1.0")
        logging.getLogger("stages.sft").warning("no learning signal")
        with console.stage("rl"):
            assert os.environ[WORKER_LOG_ENV] == str(tmp_path / "workers" / "rl.log")
        assert WORKER_LOG_ENV not in os.environ
    out, err = capsys.readouterr()
    assert "sft           started" in out and f"logs: {tmp_path / 'run.log'}" in out
    assert "no learning signal" in err
    assert "engine configuration dump" not in out + err and "library warning" not in out + err
    assert "step 10 loss=1.0" not in out + err
    log = (tmp_path / "run.log").read_text()
    for text in ("sft           started", "engine configuration dump", "library warning", "step 10 loss=1.0",
                 "no learning signal"):
        assert text in log

    chatty_library.warning("after the run")  # the library's own handler is as it was
    assert "after the run" in capsys.readouterr().err
    assert "after the run" not in (tmp_path / "run.log").read_text()
    assert LINES.propagate and LINES.level == logging.NOTSET  # a later caplog sees its lines (rl's resume line)


def test_the_error_that_ends_a_run_is_on_the_console_once_with_logs_and_resume_command(tmp_path, capsys, monkeypatch):
    """What a quiet console showed of a stage that raised: the error three times (Prefect's task-run line, the flow
    run's report and the end of its traceback). Now once, in full, then the logs and how to resume."""
    monkeypatch.setattr(QuietFilter, "shown", None)
    terminal = logging.StreamHandler(sys.stderr)  # Prefect's console handler, quiet all the process (hide_chatter)
    terminal.addFilter(QuietFilter())
    logging.getLogger().addHandler(terminal)
    prefect_task, prefect_flow = logging.getLogger("prefect.task_runs"), logging.getLogger("prefect.flow_runs")
    said = "rl.train_batch_size=512 > 256 training prompts"
    try:
        with pytest.raises(ValueError) as info, RunConsole(tmp_path, "quiet", "python -m flows.post_train x=1"):
            prefect_task.error(f"Finished in state Failed('Task run encountered an exception ValueError: {said}')",
                               extra={"task_run_name": "rl-0a1"})
            raise ValueError(said)
        prefect_flow.error("Encountered exception during execution: %r", info.value, exc_info=info.value,
                           extra={"flow_run_name": "devious-bullfinch"})
    finally:
        logging.getLogger().removeHandler(terminal)
    out, err = capsys.readouterr()
    assert (out + err).count(said) == 1, out + err
    assert err.startswith("Traceback (most recent call last):") and f"ValueError: {said}" in err
    assert 'test_console.py", line' in err and "raise ValueError(said)" in err  # the frame that raised
    assert out.splitlines()[-1] == (f"logs: {tmp_path / 'run.log'}, Ray workers' output in {tmp_path / 'workers'}/; "
                                    "once the cause is fixed, resume (finished stages are cached): "
                                    "python -m flows.post_train x=1")
    log = (tmp_path / "run.log").read_text()
    assert "Finished in state Failed" in log and f"ValueError: {said}" in log


def test_a_deployments_run_shows_its_error_once(tmp_path, capsys, monkeypatch):
    """A run that no command line started (a deployment's, or post_train called from Python) has no hide_chatter:
    the flow run's 'Encountered exception' and its traceback, logged after the RunConsole ended, showed the error a
    second time. They stay in Prefect's own log (the API's) and off the terminal."""
    monkeypatch.setattr(QuietFilter, "shown", None)
    terminal = logging.StreamHandler(sys.stderr)  # Prefect's console handler, with no filter of ours
    logging.getLogger().addHandler(terminal)
    said = "row 1 (line 2) of data.jsonl: field 'answer' is missing"
    try:
        with pytest.raises(ValueError) as info, RunConsole(tmp_path, "quiet"):
            raise ValueError(said)
        logging.getLogger("prefect.flow_runs").error("Encountered exception during execution: %r", info.value,
                                                     exc_info=info.value, extra={"flow_run_name": "x"})
        logging.getLogger("prefect.flow_runs").error("another error", exc_info=ValueError("later"))
    finally:
        logging.getLogger().removeHandler(terminal)
    err = capsys.readouterr().err
    assert err.count(said) == 1 and "another error" in err, err


def raise_through_prefect(error: Exception):
    from prefect.utilities.callables import call_with_parameters

    def stage():
        raise error

    call_with_parameters(stage, {})


def test_prefects_frames_between_ours_are_cut_to_one_line_and_run_log_has_them_all(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(QuietFilter, "shown", None)
    with pytest.raises(ValueError), RunConsole(tmp_path, "quiet"):
        raise_through_prefect(ValueError("bad row"))
    err = capsys.readouterr().err
    assert "in raise_through_prefect\n" in err and "in stage\n" in err and "raise error" in err
    assert "prefect/utilities/callables" not in err, err
    assert "  [1 frame of Prefect's engine: run.log has the whole traceback]\n  File " in err, err
    log = (tmp_path / "run.log").read_text()
    assert "the whole traceback of the error above:" in log and "prefect/utilities/callables" in log


def test_a_traceback_that_ends_in_prefect_keeps_those_frames():
    with pytest.raises(TypeError) as info:  # raised by Prefect's own call of the function
        from prefect.utilities.callables import call_with_parameters

        call_with_parameters(lambda: None, {"unexpected": 1})
    text = "".join(format_error(info.value))
    assert "frame of Prefect" not in text and "prefect/utilities/callables" in text, text


def test_rl_resume_is_a_console_line(tmp_path, capsys):
    """RL's 'resumed at step N' went to run.log only, so a rerun that started over where a resume was expected looked
    the same on the console. It is one of the flow's lines now, on the console and in run.log."""
    import random
    from types import SimpleNamespace

    import torch

    from infra.learning_signal import NoSignalMonitor
    from stages.core import make_kl_controller
    from stages.rl import RLTrainer

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    kl_ctrl = make_kl_controller("fixed", 0.001, 0.1, 10000)
    torch.save({"step": 3, "kl_ctrl": kl_ctrl.state_dict(), "python_rng": random.getstate(),
                "torch_rng": torch.get_rng_state()}, checkpoint / "trainer.pt")
    trainer = RLTrainer.__new__(RLTrainer)  # resume() alone, on stand-ins for the workers and the store
    trainer.rl = SimpleNamespace(resume_mode="auto", train_batch_size=8)
    trainer.checkpoints, trainer.tables = SimpleNamespace(latest=lambda: checkpoint), SimpleNamespace(
        truncate_after=lambda step: 2)
    trainer.actor, trainer.critic, trainer.engines = SimpleNamespace(call=lambda *args: None), None, None
    trainer.kl_ctrl, trainer.no_signal = kl_ctrl, NoSignalMonitor.create(0.9, 3)
    with RunConsole(tmp_path, "quiet"):
        trainer.resume()
    said = f"rl: resumed at step 3 from {checkpoint} (2 partial trajectory files removed)"
    out, err = capsys.readouterr()
    assert said in out.splitlines() and said not in err
    assert said in (tmp_path / "run.log").read_text()


def test_verbose_run_console_shows_everything_and_writes_run_log(tmp_path, capsys, chatty_library):
    with RunConsole(tmp_path, "verbose") as console:
        chatty_library.info("engine configuration dump")
        with console.stage("rl"):
            assert WORKER_LOG_ENV not in os.environ  # Ray workers stream to the console as Ray does
    out, err = capsys.readouterr()
    assert "engine configuration dump" in err and "Ray workers" not in out
    assert "run.log" in out and (tmp_path / "run.log").exists()


WORKER = """
import logging, os, sys
from infra.console import redirect_worker_output
redirect_worker_output()
print("vLLM engine config dump")
os.write(2, b"C-level write to fd 2\\n")
logging.getLogger("stages.workers.train_engine").info("worker info")
logging.getLogger("stages.workers.train_engine").warning("actor: 1 optimizer step(s) skipped")
"""


def test_worker_hook_sends_output_to_the_stage_log_and_our_warnings_to_the_console(tmp_path):
    log = tmp_path / "rl.log"
    log.write_text("earlier worker\n")  # every worker of a stage appends
    done = subprocess.run([sys.executable, "-c", WORKER], cwd=PROJECT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(PROJECT), WORKER_LOG_ENV: str(log)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1  # what Ray would stream to the driver: the warning
    assert "WARNING | stages.workers.train_engine - actor: 1 optimizer step(s) skipped" in done.stderr
    text = log.read_text()
    assert text.startswith("earlier worker\n")
    for line in ("vLLM engine config dump", "C-level write to fd 2", "worker info", "optimizer step(s) skipped"):
        assert line in text


def test_verbose_flag_is_an_override_so_deployments_set_it_the_same_way():
    from flows.post_train import parse_args
    from infra.config import load_config

    assert parse_args(["recipes/demo.yaml", "sft.epochs=1", "--verbose"]) == (
        "recipes/demo.yaml", ["sft.epochs=1", "tracking.console=verbose"], [])
    assert parse_args(["sft.epochs=1", "--refresh-cache"]) == (None, ["sft.epochs=1"], [])
    assert load_config(None, []).tracking.console == "quiet"


def test_ray_prints_plain_prefixes_into_a_file_or_pipe(tmp_path, monkeypatch):
    """Ray colours '(autoscaler +11s)' on any stream: raw escape codes in a file or a pipe, unless RAY_COLOR_PREFIX=0
    (which Ray reads at every line it prints); a terminal keeps the colours, a user's own setting wins."""
    from ray._private.worker import print_worker_logs

    def printed() -> str:
        out = tmp_path / "console.txt"
        with out.open("w") as stream:
            print_worker_logs({"pid": 123, "ip": "x", "localhost": "x", "lines": ["hello"]}, stream)
        return out.read_text()

    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert "\x1b[" in printed()  # what the console showed
    with RunConsole(tmp_path, "quiet"):
        assert printed() == "(pid=123) hello\n"
    assert "RAY_COLOR_PREFIX" not in os.environ and "\x1b[" in printed()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with RunConsole(tmp_path, "quiet"):
        assert "\x1b[" in printed()
