"""The Python sandbox against real processes: limits (wall clock with child processes, CPU, memory, file
size, output bytes, processes), refusals (network, processes, writes outside the work dir, by the audit hook and by
Landlock), isolation (empty
environment, fresh work dir removed after) and concurrency, shown by overlapping timestamps."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pydantic
import pytest

from stages.tools import sandbox as sandbox_module
from stages.tools.base import ToolCall
from stages.tools.calls import run_tool_call
from stages.tools.sandbox import PythonTool, Sandbox, SandboxConfig, namespaces_work, strip_code_fence
from stages.tools.sandbox_prelude import landlock_abi

FAST = {"timeout_s": 5, "cpu_time_s": 5}


def run_code(code: str, **config) -> tuple[str, Sandbox]:
    sandbox = Sandbox(SandboxConfig(**{**FAST, **config}))
    result = asyncio.run(sandbox.run(code))
    return result.text(sandbox.config), sandbox


def test_output_stdlib_and_exit_code():
    text, _ = run_code("import json, math, asyncio, decimal\nprint(json.dumps([math.factorial(5)]))\n"
                       "import sys\nprint('warn', file=sys.stderr)\nexit(3)")
    assert text == "[120]\nwarn\n[exit code 3]"  # stderr in order after stdout; exit() works without site


def test_user_error_is_text_with_user_traceback():
    text, _ = run_code("x = 1\nraise ValueError('boom')")
    assert 'File "main.py", line 2, in <module>' in text
    assert text.endswith("ValueError: boom\n[exit code 1]")
    assert "<string>" not in text.split("main.py")[0]  # the prelude's frame is not shown


def test_no_output():
    assert run_code("x = 1")[0] == "(no output)"


def test_syntax_error_is_text():
    text, _ = run_code("print(1 +)")
    assert text.startswith('  File "main.py", line 1') and "SyntaxError: invalid syntax" in text


def test_empty_environment_and_fresh_work_dir_removed():
    code = "import os\nprint(sorted(os.environ))\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\n" \
           "open('state.txt', 'w').write('x')"
    first, _ = run_code(code)
    second, _ = run_code(code)
    env, cwd1, listing = first.splitlines()
    assert env == "['HOME', 'LC_ALL', 'TMPDIR']"
    assert listing == "['main.py']"  # state.txt of the first run is not visible to the second
    cwd2 = second.splitlines()[1]
    assert cwd1 != cwd2 and second.splitlines()[2] == "['main.py']"
    assert not Path(cwd1).exists() and not Path(cwd2).exists()


def test_timeout_kills_the_process_and_its_children(tmp_path):
    """The child would write a file 1 s after start; the group is killed at 0.5 s, so it never does."""
    marker = tmp_path / "child_done"
    child_code = f"import time; time.sleep(1.0); open({str(marker)!r}, 'w').write('x')"
    code = (
        "import subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child_code!r}])\n"
        "print('child', child.pid, flush=True)\n"
        "while True:\n    pass\n"
    )
    text, _ = run_code(code, timeout_s=0.5, allow_subprocess=True)
    assert text.startswith("child ") and text.endswith("[timeout: killed after 0.5 s]")
    child_pid = int(text.split()[1])
    time.sleep(1.3)
    assert not marker.exists()
    assert _dead(child_pid)


def _dead(pid: int) -> bool:
    """Gone, or a zombie (killed; a container's PID 1 may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_cpu_limit():
    text, _ = run_code("while True:\n    pass", cpu_time_s=1, timeout_s=10)
    assert text == "[killed by SIGXCPU: CPU time limit of 1 s]"


def test_memory_bomb():
    text, _ = run_code("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))", memory_mb=128)
    assert "MemoryError" in text and text.endswith("[exit code 1]\n[memory limit: 128 MiB]")


@pytest.mark.parametrize(
    ("code", "refusal"),
    [
        ("import os\nwhile True:\n    os.fork()", "os.fork: starting or signalling processes"),  # fork bomb
        ("import os\nos.system('echo hi')", "os.system: starting or signalling processes"),
        ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen: starting or signalling processes"),
        ("import _posixsubprocess\n_posixsubprocess.fork_exec()", "subprocess: starting processes"),
        ("import os\nos.execv('/bin/true', ['true'])", "os.exec: starting or signalling processes"),
        ("import os\nos.kill(1, 9)", "os.kill: starting or signalling processes"),
        ("import ctypes", "ctypes.dlopen: this is not allowed"),
        ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (-1, -1))", "resource.setrlimit: this is not"),
    ],
    ids=["fork_bomb", "os_system", "subprocess", "fork_exec", "exec", "kill", "ctypes", "setrlimit"],
)
def test_processes_and_escape_hatches_refused(code, refusal):
    text, _ = run_code(code)
    assert f"PermissionError: {refusal}" in text and text.endswith("[exit code 1]"), text


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
    reason="needs root (to switch uid) and /usr/bin/python3 (readable by another user)",
)
def test_fork_bomb_limited_by_nproc():
    """With processes allowed, RLIMIT_NPROC stops a fork bomb; root is exempt, so run as nobody."""
    code = (
        "import os, time\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
        "    except OSError as exc:\n        print('refused', exc.errno)\n        break\n"
        "    if pid == 0:\n        time.sleep(0.5)\n        os._exit(0)\n    n += 1\nprint('forked', n)"
    )
    text, _ = run_code(code, allow_subprocess=True, max_processes=8, run_as_uid=65534,
                       python_executable="/usr/bin/python3")
    lines = text.splitlines()
    assert lines[0] == "refused 11"  # EAGAIN
    assert 0 < int(lines[1].split()[1]) < 8


def test_megabytes_of_output_truncated():
    text, _ = run_code("import sys\nwhile True:\n    sys.stdout.write('x' * 100000)", output_bytes=4096)
    assert text == "x" * 4096 + "\n[output truncated at 4096 bytes; process killed]"
    one_shot, _ = run_code("print('y' * 5_000_000)", output_bytes=1000)
    assert one_shot.startswith("y" * 1000 + "\n[output truncated")


def test_output_exactly_at_the_limit_is_not_truncated():
    text, _ = run_code("import sys\nsys.stdout.write('z' * 1000)", output_bytes=1000)
    assert text == "z" * 1000


def test_file_size_limit():
    text, _ = run_code("open('big.bin', 'wb').write(b'0' * (2 * 2**20))", file_size_mb=1)
    assert "OSError: [Errno 27] File too large" in text


def test_disk_limit_counts_all_files():
    code = ("import time\nfor i in range(8):\n    open(f'f{i}', 'wb').write(b'x' * 2**20)\n"
            "print('written', flush=True)\ntime.sleep(30)")
    text, _ = run_code(code, file_size_mb=1, disk_mb=4, timeout_s=20)
    assert text == "[disk limit: wrote more than 4 MiB; process killed]" or text == (
        "written\n[disk limit: wrote more than 4 MiB; process killed]")


@pytest.mark.parametrize("filesystem", ["auto", "audit"])
def test_writes_outside_the_work_dir_refused(tmp_path, filesystem):
    target, existing = tmp_path / "escape.txt", tmp_path / "existing.txt"
    existing.write_text("original")
    for code in (f"open({str(target)!r}, 'w').write('x')",
                 f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')",
                 f"import os\nos.link({str(existing)!r}, 'link')\nopen('link', 'a').write('x')",
                 f"import os\nos.remove({str(Path(__file__))!r})"):
        text, _ = run_code(code, filesystem=filesystem)
        assert "writing outside the working directory is not allowed" in text, text
    assert not target.exists() and Path(__file__).exists() and existing.read_text() == "original"
    text, _ = run_code("import os, shutil, tempfile\nos.makedirs('a/b')\nopen('a/b/c', 'w').write('1')\n"
                       "shutil.rmtree('a')\nwith tempfile.TemporaryFile() as f:\n    f.write(b'ok')\n"
                       "open('/dev/null', 'w').write('x')\nprint(sorted(os.listdir('.')))")
    assert text == "['main.py']\n"


needs_landlock = pytest.mark.skipif(landlock_abi() == 0, reason="needs Landlock (Linux 5.13+)")


@needs_landlock
def test_landlock_refuses_a_write_the_audit_hook_cannot_see(tmp_path):
    """A write relative to a directory descriptor passes the audit hook (Python's open event has no dir_fd)."""
    victim = tmp_path / "f"
    victim.write_text("original")
    code = (f"import os\nfolder = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
            "os.write(os.open('f', os.O_WRONLY | os.O_TRUNC, dir_fd=folder), b'x')")
    text, sandbox = run_code(code)
    assert sandbox.landlock >= 1 and "PermissionError: [Errno 13] Permission denied: 'f'" in text, text
    assert victim.read_text() == "original"
    run_code(code, filesystem="audit")  # the hook alone: the write goes through
    assert victim.read_text() == "x"


@pytest.mark.skipif(landlock_abi() < 6, reason="needs Landlock ABI 6 (Linux 6.12+) for signal scoping")
def test_landlock_refuses_a_signal_to_a_process_outside_the_sandbox():
    """pidfd_send_signal raises no audit event; the hook alone lets it kill the trainer's processes."""
    victims = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        code = "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open({}), signal.SIGKILL)\nprint('sent')"
        text, _ = run_code(code.format(victims[0].pid))
        assert "PermissionError: [Errno 1] Operation not permitted" in text, text
        text, _ = run_code(code.format(victims[1].pid), filesystem="audit")
        assert text == "sent\n" and victims[1].wait(5) == -signal.SIGKILL
        assert victims[0].poll() is None
    finally:
        for victim in victims:
            victim.kill()
            victim.wait()


@pytest.mark.skipif(landlock_abi() < 4, reason="needs Landlock ABI 4 (Linux 6.7+) for TCP")
def test_landlock_alone_refuses_tcp(listener, tmp_path):
    """The prelude's `restrict` without the audit hook or a namespace: the kernel refuses the connect."""
    port, accepted = listener
    code = ("import socket, sys\nfrom stages.tools.sandbox_prelude import landlock_abi, restrict\n"
            f"restrict(sys.argv[1], landlock_abi())\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert "PermissionError: [Errno 13]" in done.stderr, done.stderr
    time.sleep(0.3)
    assert accepted == []


def test_filesystem_landlock_where_the_kernel_has_none(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_module, "landlock_abi", lambda: 0)
    with pytest.raises(ValueError, match="filesystem='landlock' but this kernel has no Landlock"):
        Sandbox(SandboxConfig(filesystem="landlock"))
    with caplog.at_level(logging.WARNING):
        assert Sandbox(SandboxConfig()).landlock == 0
    assert "no Landlock in this kernel" in caplog.text


@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1 that records whether anything connected."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    yield server.getsockname()[1], accepted
    thread.join()
    server.close()


@pytest.mark.parametrize("network", ["auto", "audit"])
def test_network_refused(listener, network):
    port, accepted = listener
    connect = f"import socket\nsock = socket.socket()\nsock.settimeout(1)\nsock.connect(('127.0.0.1', {port}))"
    text, sandbox = run_code(connect, network=network)
    assert "PermissionError: socket.connect: network access is not allowed in the sandbox" in text
    text, _ = run_code("import socket\nsocket.create_connection(('example.com', 80))", network=network)
    assert "PermissionError: socket.getaddrinfo: network access is not allowed" in text
    time.sleep(0.3)
    assert accepted == []
    if sandbox.network_method == "namespace":  # the kernel-level barrier: no interface but a downed loopback
        text, _ = run_code("import socket\nprint(socket.if_nameindex())", network=network)
        assert text == "[(1, 'lo')]\n"


def test_network_namespace_available_here():
    """Documents the machine: unprivileged user+network namespaces work (else the audit hook alone)."""
    if namespaces_work(shutil.which("unshare"), None) is not None:
        pytest.skip(f"no network namespace here: {namespaces_work(shutil.which('unshare'), None)}")
    assert Sandbox(SandboxConfig()).network_method == "namespace"
    assert Sandbox(SandboxConfig(network="audit")).network_method == "audit"


def test_concurrent_runs_overlap():
    """Four 0.5 s sleeps overlap: every run starts before any run ends. Each waits for a common instant
    (startup on a loaded machine can take a while), then sleeps; run serially, the second could not start
    its sleep before the first ended."""
    sandbox = Sandbox(SandboxConfig(**FAST))
    code = (f"import time\ntime.sleep(max(0, {time.time() + 0.8} - time.time()))\n"
            "start = time.time()\ntime.sleep(0.5)\nprint(start, time.time())")

    async def four():
        return await asyncio.gather(*[sandbox.run(code) for _ in range(4)])

    spans = [tuple(map(float, result.output.split())) for result in asyncio.run(four())]
    assert len(spans) == 4 and all(end - start >= 0.5 for start, end in spans)
    assert max(start for start, _ in spans) < min(end for _, end in spans), spans


def test_max_concurrent_queues():
    """With one slot, runs are serial: each starts after the previous one ended."""
    sandbox = Sandbox(SandboxConfig(**FAST, max_concurrent=1))
    code = "import time\nstart = time.time()\ntime.sleep(0.1)\nprint(start, time.time())"

    async def three():
        return await asyncio.gather(*[sandbox.run(code) for _ in range(3)])

    spans = sorted(tuple(map(float, result.output.split())) for result in asyncio.run(three()))
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(2))


def test_direct_execute_takes_a_slot():
    """`execute` called directly (not through run_tool_call) keeps to max_concurrent=1: the runs are serial."""
    tool = PythonTool({**FAST, "max_concurrent": 1})
    code = "import time\nstart = time.time()\ntime.sleep(0.3)\nprint(start, time.time())"

    async def two():
        return await asyncio.gather(*[tool.execute("i", {"code": code}) for _ in range(2)])

    spans = sorted(tuple(map(float, response.text.split())) for response in asyncio.run(two()))
    assert spans[0][1] <= spans[1][0], spans  # overlapping 0.3 s sleeps would start within ms of each other


def test_run_tool_call_with_one_slot_does_not_take_it_twice():
    """run_tool_call holds the slot while execute runs; execute must not wait for it again (a deadlock with one
    slot, which the call's timeout would end with an error text after timeout_s + KILL_WAIT_S)."""
    tool = PythonTool({**FAST, "timeout_s": 1, "max_concurrent": 1})
    call = ToolCall("python", {"code": "print(6*7)"})

    async def twice():
        return await asyncio.gather(*[run_tool_call(tool, "i", call, timeout_s=1) for _ in range(2)])

    assert [(r.text, r.metrics["error"]) for r in asyncio.run(twice())] == [("42\n", 0.0)] * 2


def test_a_task_outliving_its_slot_waits_for_one():
    """A task started inside `async with slot()` inherits the held mark; once the block ends it no longer holds
    the slot, so it must wait for one (it used to run beside the next holder, past max_concurrent)."""
    sandbox = Sandbox(SandboxConfig(max_concurrent=1))

    async def scenario():
        async with sandbox.slot():
            assert sandbox.holds_slot()
            inherited = asyncio.Event()

            async def child():
                inherited.set()
                await asyncio.sleep(0.05)  # the parent leaves the block meanwhile
                return sandbox.holds_slot()

            task = asyncio.create_task(child())
            await inherited.wait()
        return await task, sandbox.holds_slot()

    assert asyncio.run(scenario()) == (False, False)


def test_python_tool_through_run_tool_call():
    tool = PythonTool({"timeout_s": 0.5})
    assert tool.name == "python" and tool.sandbox.config.timeout_s == 0.5
    response = asyncio.run(run_tool_call(tool, "i", ToolCall("python", {"code": "```python\nprint(6*7)\n```"}), 5))
    assert response.text == "42\n" and response.metrics["error"] == 0.0
    assert response.metrics["sandbox/failed"] == 0.0
    hung = asyncio.run(run_tool_call(tool, "i", ToolCall("python", {"code": "import time\ntime.sleep(9)"}), 5))
    assert hung.text == "[timeout: killed after 0.5 s]" and hung.metrics["sandbox/timeout"] == 1.0
    # the sandbox's own limit fired first (the loop's is later): still counted, in tool/timeouts and tool/errors
    assert hung.metrics["timeout"] == 1.0 and hung.metrics["error"] == 1.0
    raised = asyncio.run(run_tool_call(tool, "i", ToolCall("python", {"code": "raise ValueError('x')"}), 5))
    assert "[exit code 1]" in raised.text and raised.metrics["error"] == 1.0 and raised.metrics["timeout"] == 0.0


def test_a_call_waiting_for_a_sandbox_slot_is_not_timed_out_for_it():
    # 4 calls of 0.5 s on 2 slots under a 0.8 s call timeout: the last two wait 0.5 s, then run 0.5 s
    tool = PythonTool({**FAST, "max_concurrent": 2})
    call = ToolCall("python", {"code": "import time\ntime.sleep(0.5)\nprint('done')"})

    async def four():
        return await asyncio.gather(*[run_tool_call(tool, "i", call, timeout_s=0.8) for _ in range(4)])

    assert [r.text for r in asyncio.run(four())] == ["done\n"] * 4


def test_the_sandboxs_own_limit_wins_over_a_shorter_call_timeout():
    # the program's output so far and the sandbox's note reach the model, not a bare timeout error
    tool = PythonTool({"timeout_s": 0.5})
    call = ToolCall("python", {"code": "import time\nprint('started', flush=True)\ntime.sleep(9)"})
    response = asyncio.run(run_tool_call(tool, "i", call, timeout_s=0.3))
    assert response.text == "started\n[timeout: killed after 0.5 s]"  # not "error: tool 'python' timed out"
    assert response.metrics["timeout"] == 1.0  # the sandbox's limit: counted in tool/timeouts all the same


def test_cancelled_run_kills_the_process(tmp_path):
    """A caller that gives up on the call (a cancelled rollout) cancels the run: the process must not live on."""
    tool = PythonTool({"timeout_s": 30, "work_root": str(tmp_path)})
    call = ToolCall("python", {"code": "import time\ntime.sleep(30)"})
    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(run_tool_call(tool, "i", call, timeout_s=60), 0.5))
    time.sleep(0.2)
    assert _processes_in(tmp_path) == [] and list(tmp_path.iterdir()) == []


def _processes_in(folder: Path) -> list[int]:
    """Live (non-zombie) processes whose working directory is under `folder`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            inside = entry.name.isdigit() and os.readlink(entry / "cwd").startswith(str(folder))
            if inside and not _dead(int(entry.name)):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_config_errors():
    with pytest.raises(pydantic.ValidationError, match="memroy_mb"):
        PythonTool({"memroy_mb": 100})
    with pytest.raises(pydantic.ValidationError, match="timeout_s"):
        SandboxConfig(timeout_s=0)


def test_strip_code_fence():
    assert strip_code_fence("```python\nprint(1)\n```") == "print(1)"
    assert strip_code_fence("```\nx = 1\ny = 2```") == "x = 1\ny = 2"
    assert strip_code_fence("print('```')") == "print('```')"
