"""What a flow run prints, and where the rest of its output goes (`tracking.console`).

quiet (the default): the console shows the flow's own lines (where the logs are, one line as each stage starts
and ends, the final table), the SFT and RL progress bars, warnings from our code (in the driver and in Ray
workers) and every error with its traceback (the error that ends a run once, then the log file and the command
that resumes the run). The rest goes to log files in the run folder (outputs/runs/<run_id>/):

    run.log              the driver's Python logging at INFO: Prefect's flow and task lines, our stages' INFO
                         lines, the `console` tracking backend's metric lines, Ray's and transformers' driver
                         logs, Python warnings
    workers/<stage>.log  stdout and stderr of the stage's Ray worker processes: vLLM, transformers, torch

verbose: every log line on the console as well and Ray's workers streamed to it by Ray (`log_to_driver`), as
before this module existed; run.log is written all the same.

The driver's log records are sorted by a filter on every console handler (Prefect's on the root logger, and
those that Ray, transformers and torch put on their own loggers). Ray workers are other processes, on a
cluster that a stage starts or on a persistent one (`ray.address`), so `init_ray` (stages/workers/group.py)
gives the job a `worker_process_setup_hook`, `redirect_worker_output`, which points each worker's stdout and
stderr file descriptors at the stage's log file; our loggers there also write warnings to the worker's
original stderr, which Ray streams to the driver's console.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from io import StringIO
from pathlib import Path

from infra.prefect_env import PACKAGES
from infra.redact import RedactFilter

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # what our flow and tasks log through get_run_logger()
WORKER_LOG_ENV = "RLPIPE_WORKER_LOG"  # the running stage's worker log file; set only in quiet mode
WORKER_HOOK = "infra.console.redirect_worker_output"
FORMAT = "%(asctime)s.%(msecs)03d | %(levelname)-7s | {} - %(message)s"  # Prefect's, for one look in every log
INTERRUPTED = "aborted by an interrupt signal"  # Prefect's words for a KeyboardInterrupt in a flow or task run
LINES = logging.getLogger("flows.console")  # the flow's own lines: on the console in both modes, and in run.log
WHOLE = logging.getLogger("flows.run_log")  # run.log only: the whole traceback of the error that ended the run


class QuietFilter(logging.Filter):
    """What a quiet console shows of the log records: errors from anyone, warnings from our code, a task run's
    failed attempt that Prefect retries (logged at INFO). A run's error is printed once, by `RunConsole` as it ends
    the run (`failed`); Prefect's own reports of it stay off the console (`prefect_failure_report`), and so do
    Prefect's reports of a Ctrl-C ('Crash detected! Execution was aborted by an interrupt signal.', for the task and
    for the flow): the command line says it was interrupted, and how to resume (flows/interrupt.py)."""

    shown: BaseException | None = None  # the error a RunConsole printed last; one for the process, as the console

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name in RUN_LOGGERS and (INTERRUPTED in record.getMessage() or prefect_failure_report(record)):
            return False
        if record.name == "prefect.task_runs" and record.getMessage().startswith("Task run failed"):
            return True
        ours = record.name.split(".")[0] in PACKAGES or record.name in RUN_LOGGERS
        return record.levelno >= logging.ERROR or (record.levelno >= logging.WARNING and ours)


def prefect_failure_report(record: logging.LogRecord) -> bool:
    """Whether `record` is Prefect's report of an error that the flow prints itself: a task run's 'Task run failed
    with exception: ...' (with its traceback, when no retry follows) and 'Finished in state Failed(...)' (a task
    runs only inside a RunConsole, which prints every error that ends the run), or the flow run's 'Encountered
    exception during execution' (with its traceback through Prefect's frames) of the error a RunConsole showed."""
    if record.levelno < logging.ERROR:
        return False  # a retried attempt's 'Task run failed ... Retry 1/1 will start immediately' is INFO
    if record.name == "prefect.task_runs":
        return record.getMessage().startswith(("Task run failed", "Finished in state"))
    return shown_error_report(record)


def shown_error_report(record: logging.LogRecord) -> bool:
    """Whether `record` carries the error a RunConsole printed (the flow run's 'Encountered exception')."""
    return QuietFilter.shown is not None and bool(record.exc_info) and record.exc_info[1] is QuietFilter.shown


def not_shown_error(record: logging.LogRecord) -> bool:
    return not shown_error_report(record)


MACHINERY = tuple(os.path.dirname(module.__file__) + os.sep for module in (asyncio, concurrent.futures))


def format_error(error: BaseException) -> list[str]:
    """traceback.format_exception(error), with each run of frames in Prefect's engine (and the asyncio and
    concurrent.futures calls it makes) that lies between two other frames cut to one line: ~13 frames between the
    flow's call of a stage and the stage's task. Frames at the end of a traceback (an error raised inside Prefect)
    are kept."""
    import prefect

    machinery = (*MACHINERY, os.path.dirname(prefect.__file__) + os.sep)
    chunks, cut = [], []
    for chunk in traceback.TracebackException.from_exception(error).format():
        if chunk.startswith('  File "') and chunk[len('  File "'):].startswith(machinery):
            cut.append(chunk)
            continue
        if cut and chunk.startswith('  File "'):
            frames = "1 frame" if len(cut) == 1 else f"{len(cut)} frames"
            chunks.append(f"  [{frames} of Prefect's engine: run.log has the whole traceback]\n")
        elif cut:
            chunks.extend(cut)  # the traceback ends in them: kept
        chunks.append(chunk)
        cut = []
    return chunks + cut


def console_handlers() -> list[tuple[logging.Logger, logging.Handler]]:
    """(logger, handler) for every handler that writes to a terminal stream: not a file, not pytest's caplog."""
    loggers = [logging.getLogger(), *(x for x in list(logging.Logger.manager.loggerDict.values())
                                      if isinstance(x, logging.Logger))]
    return [(logger, handler) for logger in loggers for handler in logger.handlers
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            and not isinstance(handler.stream, StringIO)]


def hide_chatter() -> None:
    """Command line, quiet: Prefect's INFO lines from before and after the flow function (its temporary
    server, the flow run's start and end) stay off the console too. For the rest of the process."""
    quiet = QuietFilter()
    for _, handler in console_handlers():
        handler.addFilter(quiet)


class RunConsole:
    """The console and log files of one flow run: a context manager; `line` prints one of the flow's lines. An
    error that ends the run is printed once, with the command that resumes the run (`resume`) where there is one."""

    def __init__(self, run_dir: str | Path, mode: str, resume: str | None = None):
        self.run_dir, self.quiet, self.resume = Path(run_dir), mode == "quiet", resume
        self.log, self.workers = self.run_dir / "run.log", self.run_dir / "workers"
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> RunConsole:
        from prefect.logging.formatters import PrefectFormatter

        file = logging.FileHandler(self.log)
        file.setLevel(logging.INFO)
        file.setFormatter(PrefectFormatter(FORMAT.format("%(name)s"), "%H:%M:%S",
                                           flow_run_fmt=FORMAT.format("Flow run %(flow_run_name)r"),
                                           task_run_fmt=FORMAT.format("Task run %(task_run_name)r")))
        self._add(logging.getLogger(), file)
        self._add(WHOLE, file)
        self._redact_everywhere()
        if not sys.stderr.isatty() and "RAY_COLOR_PREFIX" not in os.environ:
            self._plain_ray_prefixes()
        if self.quiet:
            self._silence(file)
        stdout, stderr = logging.StreamHandler(sys.stdout), logging.StreamHandler(sys.stderr)
        stdout.addFilter(lambda record: record.levelno < logging.ERROR)
        stderr.setLevel(logging.ERROR)  # the run's error (`failed`)
        for stream in (stdout, stderr):
            stream.setFormatter(logging.Formatter("%(message)s"))
            stream.addFilter(RedactFilter())
        # Prefect's API handler too, so the flow run's log in the Prefect UI has these lines (and the table).
        for handler in [stdout, stderr, file, *logging.getLogger("prefect.extra").handlers]:
            self._add(LINES, handler)
        for logger in (LINES, WHOLE):
            level, propagate = logger.level, logger.propagate
            self._undo.append(lambda logger=logger, level=level, propagate=propagate: (
                logger.setLevel(level), setattr(logger, "propagate", propagate)))
            logger.setLevel(logging.INFO)
            logger.propagate = False
        self.line(f"logs: {self.where()}" + ("; tracking.console=verbose or --verbose shows them here"
                                             if self.quiet else ""))
        return self

    def __exit__(self, _type, error: BaseException | None, _traceback) -> None:
        if isinstance(error, Exception):  # Ctrl-C: the command line says how to resume (flows/interrupt.py)
            self.failed(error)
        else:
            self.line(f"logs: {self.where()}")
        for undo in reversed(self._undo):
            undo()

    def failed(self, error: Exception) -> None:
        """The error that ends the run, in full (its traceback, a reward function's from its worker process first:
        the cause; runs of Prefect's frames between ours cut to one line), then where the logs are and how to resume.
        Prefect's reports of it stay off the console, also the flow run's after this RunConsole ends (a deployment's
        run: no `hide_chatter`), in quiet mode. run.log has the whole traceback as well."""
        QuietFilter.shown = error
        if self.quiet:
            for _, handler in console_handlers():
                handler.addFilter(not_shown_error)  # once per handler (a Filterer keeps no duplicates)
        LINES.error("".join(format_error(error)).rstrip("\n"))
        WHOLE.error("the whole traceback of the error above:\n%s",
                    "".join(traceback.format_exception(error)).rstrip("\n"))
        again = f"; once the cause is fixed, resume (finished stages are cached): {self.resume}" if self.resume else ""
        self.line(f"logs: {self.where()}{again}")

    def where(self) -> str:
        return f"{self.log}" + (f", Ray workers' output in {self.workers}/" if self.quiet else "")

    def line(self, text: str) -> None:
        LINES.info(text)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """While stage `name` runs, in quiet mode its Ray workers write their output to workers/<name>.log."""
        if not self.quiet:
            yield
            return
        self.workers.mkdir(exist_ok=True)
        os.environ[WORKER_LOG_ENV] = str(self.workers / f"{name}.log")
        try:
            yield
        finally:
            del os.environ[WORKER_LOG_ENV]

    def _redact_everywhere(self) -> None:
        """Every handler (console, run.log, Prefect's API handler that fills its database) masks secrets."""
        redact = RedactFilter()
        loggers = [logging.getLogger(), *(x for x in list(logging.Logger.manager.loggerDict.values())
                                          if isinstance(x, logging.Logger))]
        for handler in {h for logger in loggers for h in logger.handlers}:
            handler.addFilter(redact)
            self._undo.append(lambda handler=handler: handler.removeFilter(redact))

    def _plain_ray_prefixes(self) -> None:
        """Ray colours the prefixes of the lines it prints for workers and its autoscaler ('(autoscaler +11s)') on
        any stream; into a file or a pipe they would be raw escape codes. Ray reads the switch at every line."""
        os.environ["RAY_COLOR_PREFIX"] = "0"
        self._undo.append(lambda: os.environ.pop("RAY_COLOR_PREFIX", None))

    def _add(self, logger: logging.Logger, handler: logging.Handler) -> None:
        logger.addHandler(handler)
        self._undo.append(lambda: logger.removeHandler(handler))

    def _silence(self, file: logging.Handler) -> None:
        from transformers.utils import logging as hf_logging  # its handler is found below, its bars turned off

        quiet = QuietFilter()
        for logger, handler in console_handlers():
            handler.addFilter(quiet)
            self._undo.append(lambda handler=handler: handler.removeFilter(quiet))
            if not logger.propagate:  # its records never reach the root's handlers
                self._add(logger, file)
        logging.captureWarnings(True)  # library warnings (torch, transformers) go to run.log as records
        self._undo.append(lambda: logging.captureWarnings(False))
        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            self._undo.append(hf_logging.enable_progress_bar)


@contextmanager
def bars_closed_on_error() -> Iterator[None]:
    """Around a stage's work in its task: when it raises (an error, Ctrl-C), the progress bars it left open are
    closed, so that the next line (Prefect's report of the error, the command line's message) starts a line of its
    own instead of running on after the bar."""
    try:
        yield
    except BaseException:
        from tqdm import tqdm

        for bar in list(tqdm._instances):
            bar.close()
        raise


def redirect_worker_output() -> None:
    """Ray's `worker_process_setup_hook` in quiet mode: this worker's stdout and stderr go to the stage's log
    file (`WORKER_LOG_ENV`, appended to by every worker of the stage); warnings of our loggers also go to the
    worker's original stderr, which Ray streams to the driver's console. The worker ignores Ctrl-C."""
    path = os.environ.get(WORKER_LOG_ENV)
    if not path:
        return
    # Ctrl-C in the terminal reaches the workers of a local cluster too (its processes share the terminal's
    # process group): the driver stops them, and says how to resume, while a worker that Ctrl-C ended made Ray print
    # "(raylet) Task ... failed" on the console.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.makedirs(os.path.dirname(path), exist_ok=True)  # a worker on another node writes it there
    console = os.fdopen(os.dup(2), "w", buffering=1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    to_file, to_console = logging.StreamHandler(sys.stderr), logging.StreamHandler(console)
    to_console.setLevel(logging.WARNING)
    for handler in (to_file, to_console):
        handler.setFormatter(logging.Formatter(FORMAT.format("%(name)s"), "%H:%M:%S"))
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.addHandler(to_file)
        logger.addHandler(to_console)
