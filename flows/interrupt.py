"""Ctrl-C on the command line: a short message with the command that resumes the run, exit code 130.

A run resumes by running the same command again: the stages that finished are Prefect cache hits, SFT and RL go on
from their last checkpoint (their cache key names them), evaluation re-runs only for models not yet evaluated.
`--refresh-cache` is left out of the command printed, or the second run would start every stage over. A run that
fails names the same command after its error (`resume_after_failure`, printed by infra/console.py's RunConsole).

The terminal sends SIGINT to every process of its foreground process group, Prefect's temporary server included
(started by the first API call when no PREFECT_API_URL names a server): it died with the flow, so Prefect's report
of the interrupted run ("Crashed") went to a server that was gone, with retries (one to four minutes, and ~100 lines
of httpx tracebacks). `start_prefect_server` starts that server before the flow, from the main thread, in a process
group of its own, with Linux's parent-death signal: it outlives a Ctrl-C long enough to record the run's end, and
still ends with this process however that ends (SIGKILL of the process group, a closed terminal), as it did when
it shared the group. The flow stops it at exit as before (Prefect's atexit). Elsewhere than Linux it starts as
Prefect starts it.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a command that Ctrl-C ended
REFRESH = "--refresh-cache"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
_command_line: list[str] | None = None  # main()'s arguments while it runs the flow (running_from_command_line)


class _OwnGroupPopen(subprocess.Popen):
    """subprocess.Popen whose child leads a process group of its own (Ctrl-C in the terminal does not reach it) and
    gets SIGTERM when the thread that started it ends (the main thread: when this process ends)."""

    def __init__(self, *args, **kwargs):
        prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()  # resolved here, not in the child

        def end_with_parent() -> None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # it ended before the line above
                os._exit(1)

        super().__init__(*args, process_group=0, preexec_fn=end_with_parent, **kwargs)


class _Subprocess(types.ModuleType):
    """The `subprocess` module as Prefect's server module sees it while `start_prefect_server` runs: Popen aside."""

    Popen = _OwnGroupPopen

    def __getattr__(self, name: str):
        return getattr(subprocess, name)


def start_prefect_server() -> None:
    """Prefect's temporary server, when the flow will use one, started now (see the module docstring); call it from
    the main thread."""
    from prefect.server.api import server
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value() or sys.platform != "linux":
        return
    server.subprocess = _Subprocess("subprocess")
    try:
        server.SubprocessASGIServer().start()  # the instance Prefect's clients use (no port given)
    finally:
        server.subprocess = subprocess


def quiet_while_starting() -> None:
    """Until main() puts Python's handler back: Ctrl-C while the modules load (torch, Prefect, Ray: seconds) exits
    with EXIT_CODE and one line, not the import machinery's traceback; nothing has run or been written yet."""
    signal.signal(signal.SIGINT, _interrupted_while_starting)


def _interrupted_while_starting(_signum: int, _frame) -> None:
    print("\ninterrupted (Ctrl-C) while starting: nothing ran", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CODE)


@contextmanager
def running_from_command_line(argv: list[str]) -> Iterator[None]:
    """While main() runs the flow with `argv`: a run that fails says how to resume (`resume_after_failure`)."""
    global _command_line
    _command_line = list(argv)
    try:
        yield
    finally:
        _command_line = None


def from_command_line() -> bool:
    """Whether main() runs the flow (else a deployment's worker or a Python caller does)."""
    return _command_line is not None


def resume_after_failure() -> str | None:
    """The command that resumes this process's run, when it runs from the command line (main); None in a
    deployment's run or a flow called from Python, which have no command to repeat."""
    return None if _command_line is None else resume_command(_command_line)


def resume_command(argv: list[str]) -> str:
    """The command line that resumes the run started with `argv` (this process's arguments after the module)."""
    return command_line([a for a in argv if a != REFRESH])


def command_line(args: list[str]) -> str:
    """The command that runs the flow with `args` as this one was run: `make demo ARGS=...` under make's demo
    target, else the interpreter as invoked and `-m flows.post_train`."""
    if os.environ.get("MAKELEVEL") and args[:1] == ["recipes/demo.yaml"]:
        rest = shlex.join(args[1:])
        return "make demo" + (f" ARGS={shlex.quote(rest)}" if rest else "")
    return shlex.join([sys.orig_argv[0], "-m", "flows.post_train", *args])


def interrupted_message(argv: list[str]) -> str:
    again = ("run it again without --refresh-cache (which would start every stage over)" if REFRESH in argv
             else "run the same command again")
    return (f"interrupted (Ctrl-C). Finished stages are cached and SFT and RL go on from their last checkpoint; to "
            f"resume, {again}:\n  {resume_command(argv)}")
