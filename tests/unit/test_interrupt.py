"""Ctrl-C on the command line (flows/interrupt.py): a short message with the command that resumes the run and exit
code 130, not ~90 lines of Prefect's and httpx's tracebacks; Prefect's own reports of the interrupt stay in run.log."""

from __future__ import annotations

import logging
import shlex
import sys

import pytest

import flows.post_train as post_train_module
from flows.interrupt import EXIT_CODE, resume_command
from flows.post_train import main
from infra.console import QuietFilter
from infra.prefect_env import PROJECT_DIR


@pytest.fixture
def interrupted_flow(monkeypatch):
    """The flow, as the command line calls it, stopped by Ctrl-C (Prefect re-raises the KeyboardInterrupt)."""
    def flow(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(post_train_module, "post_train", flow)
    monkeypatch.setattr(post_train_module.interrupt, "start_prefect_server", lambda: None)
    monkeypatch.delenv("MAKELEVEL", raising=False)


def test_ctrl_c_says_how_to_resume_and_exits_130(interrupted_flow, tmp_path, capsys):
    argv = ["recipes/demo.yaml", f"storage.root={tmp_path / 'my store'}", f"run.output_dir={tmp_path / 'out'}"]
    assert main(argv) == EXIT_CODE == 130
    out, err = capsys.readouterr()
    command = shlex.join([sys.orig_argv[0], "-m", "flows.post_train", *argv])
    assert err == ("\ninterrupted (Ctrl-C). Finished stages are cached and SFT and RL go on from their last "
                   f"checkpoint; to resume, run the same command again:\n  {command}\n")
    assert "Traceback" not in out + err
    assert shlex.split(command)[3:] == argv  # the space in the path survives a copy into the shell


def test_the_resume_command_leaves_out_refresh_cache(interrupted_flow, tmp_path, capsys):
    argv = ["--refresh-cache", f"storage.root={tmp_path}", "--verl", "trainer.total_epochs=2"]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "run it again without --refresh-cache (which would start every stage over)" in err
    assert err.rstrip().endswith(f"-m flows.post_train storage.root={tmp_path} --verl trainer.total_epochs=2")


def test_under_make_demo_the_command_is_make_demo(monkeypatch):
    monkeypatch.setenv("MAKELEVEL", "1")
    assert resume_command(["recipes/demo.yaml"]) == "make demo"
    assert resume_command(["recipes/demo.yaml", "--verbose", "sft.optim.lr=1e-4"]) == \
        "make demo ARGS='--verbose sft.optim.lr=1e-4'"
    assert resume_command(["recipes/dapo.yaml"]).endswith(" -m flows.post_train recipes/dapo.yaml")


@pytest.mark.parametrize("logger", ["prefect.task_runs", "prefect.flow_runs"])
@pytest.mark.parametrize("message", ["Crash detected! Execution was aborted by an interrupt signal.",
                                     "Finished in state Crashed('Execution was aborted by an interrupt signal.')"])
def test_prefects_reports_of_the_interrupt_stay_off_a_quiet_console(logger, message):
    record = logging.LogRecord(logger, logging.ERROR, __file__, 1, message, None, None)
    assert not QuietFilter().filter(record)


def test_prefects_server_process_leads_its_own_group_and_ends_with_its_parent(tmp_path):
    """What start_prefect_server gives Prefect's server: Ctrl-C in the terminal (the foreground process group) does
    not reach it; SIGKILL of its parent ends it (parent-death signal), as sharing the group did."""
    import os
    import subprocess
    import time

    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, %r)\n"
        "from flows.interrupt import _OwnGroupPopen\n"
        "child = _OwnGroupPopen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "open(%r, 'w').write(str(child.pid)); time.sleep(60)\n") % (str(PROJECT_DIR), str(pid_file))])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert os.getpgid(child) == child != os.getpgid(parent.pid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
