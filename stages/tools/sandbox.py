"""`PythonTool` (`python`, argument `code`): run model-written Python in a fresh, limited process per call.

One call = one process, started with asyncio (calls run concurrently, at most `max_concurrent` at once: every
run takes a `slot()`, unless the code awaiting it holds one already, as `run_tool_call` does around `execute`):

    [unshare -rn] python -I -S -B -u -c <sandbox_prelude.py> <settings>     cwd: a fresh temp dir, removed after

- Limits (`preexec_fn`, kernel-enforced): RLIMIT_CPU (SIGXCPU at `cpu_time_s`), RLIMIT_AS (`memory_mb`: a
  MemoryError in the code), RLIMIT_FSIZE (`file_size_mb`: "File too large"), RLIMIT_NOFILE, RLIMIT_CORE = 0;
  the work dir's total size is polled every 0.1 s and the group killed past `disk_mb` (RLIMIT_FSIZE bounds
  one file, not how many; the work dir shares the trainer's disk);
  RLIMIT_NPROC is set by the prelude (see there why). `start_new_session`: the process leads its own group,
  and a wall-clock timeout (`timeout_s`) SIGKILLs the whole group.
- Output: stdout and stderr through one pipe (their order kept), read in chunks; past `output_bytes` the
  rest is dropped, a marker added and the group killed, so a process printing megabytes never fills memory.
- Isolation: `-I` (no user site, no PYTHON* variables, no script dir on sys.path), `-S` (no site-packages:
  the standard library only), an environment with nothing from the parent (HOME and TMPDIR are the work
  dir), stdin from /dev/null.
- No network: where unprivileged user namespaces work (probed once: `unshare -rn true`), the process runs in
  a new user + network namespace that holds only a downed loopback, so no socket can reach anything; the
  prelude's audit hook refuses socket connect/bind/send/lookup in every case, and is the only barrier
  without namespaces (`network: audit`), or when `network: auto` finds none (with a warning).
- Processes: the audit hook refuses fork/exec/spawn/system/subprocess/kill (`allow_subprocess: true` lifts
  that; RLIMIT_NPROC then bounds a fork bomb, except for root, whom the kernel exempts). A child that starts
  its own session escapes the group kill; there is no PID namespace, because `unshare --pid --fork` does not
  pass on how the child died (SIGXCPU reads as exit 0 or 1 with util-linux 2.38).
- Files and signals: where the kernel has Landlock (`filesystem: auto`, probed once), the prelude restricts
  the process before any user code runs: writes only inside the work dir (and /dev/null) by any path or
  descriptor, from Landlock ABI 4 no TCP, from ABI 6 no signal to a process outside the sandbox
  (sandbox_prelude.py). Without it (`filesystem: audit`, or `auto` on an older kernel, with a warning) the audit
  hook alone refuses Python-level writes outside the work dir, and misses a write relative to a directory
  descriptor and `signal.pidfd_send_signal`.

Running as root: RLIMIT_NPROC does not bind root. Without Landlock, files writable by root are writable by the
code except that the audit hook refuses Python-level writes outside the work dir. `run_as_uid` runs the code as
another user (needs a `python_executable` that user can read, e.g. /usr/bin/python3 when the venv lives in /root).

The tool's text is the output, then one line per abnormal end: `[timeout: killed after 10 s]`,
`[output truncated at 65536 bytes; process killed]`, `[disk limit: wrote more than 256 MiB; process killed]`,
`[killed by SIGXCPU: CPU time limit of 10 s]`,
`[exit code 3]`. User code errors are text, never exceptions.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stages.tools.base import BaseTool, ToolFunction, ToolResponse, ToolSchema
from stages.tools.sandbox_prelude import landlock_abi

logger = logging.getLogger(__name__)

PRELUDE = (Path(__file__).parent / "sandbox_prelude.py").read_text(encoding="utf-8")
CHUNK_BYTES = 65536
KILL_WAIT_S = 5.0  # after SIGKILL a process is gone at once unless stuck in the kernel
DISK_POLL_S = 0.1
_FENCE = re.compile(r"^\s*```[\w+-]*\n(.*?)\n?```\s*$", re.DOTALL)
# the slots the running code is inside: a context variable, so a task started under `async with slot()`
# (asyncio.wait_for's, gather's) holds it too while it is held, and other tasks do not
_HELD_SLOTS: contextvars.ContextVar[tuple[Slot, ...]] = contextvars.ContextVar("sandbox_slots", default=())


class SandboxConfig(BaseModel):
    """Limits of one sandboxed run (`config:` of the `python` tool in the tools YAML)."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(default=10.0, gt=0, le=3600, description="Wall-clock limit; the group is killed.")
    cpu_time_s: int = Field(default=10, gt=0, le=3600, description="CPU seconds (RLIMIT_CPU), then SIGXCPU.")
    memory_mb: int = Field(default=512, ge=64, description="Address space (RLIMIT_AS) in MiB.")
    output_bytes: int = Field(default=65536, ge=256, description="Bytes of stdout+stderr kept; then killed.")
    file_size_mb: int = Field(default=16, ge=0, description="Largest file the code may write (RLIMIT_FSIZE).")
    disk_mb: int = Field(default=256, ge=1, description="All files in the work dir together; then killed.")
    max_processes: int = Field(
        default=16, ge=1, description="RLIMIT_NPROC (threads count too; root is exempt). Counted per namespace; "
        "with network='audit' it counts all processes of the uid, the trainer's included.")
    max_open_files: int = Field(default=64, ge=16, description="RLIMIT_NOFILE.")
    max_concurrent: int = Field(default=8, ge=1, description="Runs at once per tool object; others wait.")
    network: Literal["auto", "namespace", "audit"] = Field(
        default="auto", description="No-network method: a network namespace (auto: when available) or the "
        "audit hook alone.")
    filesystem: Literal["auto", "landlock", "audit"] = Field(
        default="auto", description="Barrier to writes outside the work dir (and, by the kernel's Landlock ABI, "
        "to TCP and to signals out of the sandbox): Landlock (auto: when the kernel has it) or the audit hook alone.")
    allow_subprocess: bool = Field(default=False, description="Let the code start processes (bounded by NPROC).")
    python_executable: str | None = Field(default=None, description="Interpreter; None = this one's.")
    run_as_uid: int | None = Field(default=None, ge=1, description="Run as this uid (and gid); needs root.")
    work_root: str | None = Field(default=None, description="Where temp work dirs go; None = tempfile's.")


@dataclass
class SandboxResult:
    """What happened to one run; `text()` is what the model sees."""

    output: str
    exit_code: int | None  # negative: killed by that signal; None: never started
    timed_out: bool
    truncated: bool
    duration_s: float
    over_disk: bool = False

    def text(self, config: SandboxConfig) -> str:
        notes = []
        if self.truncated:
            notes.append(f"[output truncated at {config.output_bytes} bytes; process killed]")
        if self.over_disk:
            notes.append(f"[disk limit: wrote more than {config.disk_mb} MiB; process killed]")
        if self.timed_out:
            notes.append(f"[timeout: killed after {config.timeout_s:g} s]")
        elif self.exit_code and not (self.truncated or self.over_disk):  # we killed it: the status says nothing
            notes.append(_exit_note(self.exit_code, config))
        if "MemoryError" in self.output[-300:]:
            notes.append(f"[memory limit: {config.memory_mb} MiB]")
        if not notes:
            return self.output or "(no output)"
        return "\n".join([self.output.rstrip("\n")] * bool(self.output) + notes)


def _exit_note(exit_code: int, config: SandboxConfig) -> str:
    if exit_code > 0:
        return f"[exit code {exit_code}]"
    signum = -exit_code
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    if signum == signal.SIGXCPU:
        return f"[killed by {name}: CPU time limit of {config.cpu_time_s} s]"
    return f"[killed by {name}]"


@functools.cache
def namespaces_work(unshare: str | None, uid: int | None) -> str | None:
    """None when `unshare -rn` works for `uid` here, else why not (probed once per process)."""
    if unshare is None:
        return "the unshare command is not installed"
    try:
        probe = subprocess.run([unshare, "-rn", "true"], check=False, capture_output=True, timeout=10,
                               user=uid, group=uid, extra_groups=[] if uid is not None else None)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{unshare} -rn failed: {exc}"
    return None if probe.returncode == 0 else f"{unshare} -rn failed: {probe.stderr.decode(errors='replace')}"


def _set_limits(limits: tuple[tuple[int, int, int], ...]) -> None:
    """preexec_fn: only setrlimit calls between fork and exec (nothing that could take a lock)."""
    for kind, soft, hard in limits:
        resource.setrlimit(kind, (soft, hard))


class Sandbox:
    """Runs code under one `SandboxConfig`; decides the namespace question once, at construction."""

    def __init__(self, config: SandboxConfig):
        self.config = config
        self.python = config.python_executable or sys.executable
        unshare = shutil.which("unshare")
        problem = None if config.network == "audit" else namespaces_work(unshare, config.run_as_uid)
        if config.network == "namespace" and problem:
            raise ValueError(f"python tool network='namespace' but {problem}; use network='auto' or 'audit'")
        if config.network == "auto" and problem:
            logger.warning("python tool: no network namespace (%s); network is refused by the audit hook only",
                           problem)
        self.network_method = "audit" if problem or config.network == "audit" else "namespace"
        self._prefix = [unshare, "-rn", "--"] if self.network_method == "namespace" else []
        self.landlock = 0 if config.filesystem == "audit" else landlock_abi()
        if config.filesystem == "landlock" and not self.landlock:
            raise ValueError("python tool filesystem='landlock' but this kernel has no Landlock (Linux 5.13+ with "
                             "landlock in its LSM list); use filesystem='auto' or 'audit'")
        if config.filesystem == "auto" and not self.landlock:
            logger.warning("python tool: no Landlock in this kernel; writes outside the work dir and signals are "
                           "refused by the audit hook only")
        if os.geteuid() == 0 and config.run_as_uid is None:
            logger.info("python tool runs code as root: RLIMIT_NPROC does not bind root; set run_as_uid to change")
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _command(self) -> list[str]:
        settings = {"max_processes": self.config.max_processes, "allow_subprocess": self.config.allow_subprocess,
                    "landlock": self.landlock}
        return [*self._prefix, self.python, "-I", "-S", "-B", "-u", "-c", PRELUDE, json.dumps(settings)]

    def _limits(self) -> tuple[tuple[int, int, int], ...]:
        """(resource, soft, hard); CPU's hard limit is 1 s above the soft one, because at the hard limit the
        kernel sends SIGKILL, and SIGXCPU (soft) says why the process died."""
        config = self.config
        return (
            (resource.RLIMIT_CPU, config.cpu_time_s, config.cpu_time_s + 1),
            (resource.RLIMIT_AS, config.memory_mb * 2**20, config.memory_mb * 2**20),
            (resource.RLIMIT_FSIZE, config.file_size_mb * 2**20, config.file_size_mb * 2**20),
            (resource.RLIMIT_NOFILE, config.max_open_files, config.max_open_files),
            (resource.RLIMIT_CORE, 0, 0),
        )

    def _semaphore(self) -> asyncio.Semaphore:
        return self._semaphores.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(self.config.max_concurrent))

    def slot(self) -> Slot:
        """One of `max_concurrent` places to run a program (per event loop), for `async with`."""
        return Slot(self._semaphore())

    def holds_slot(self) -> bool:
        """Whether the running code is inside `async with slot()` of this sandbox (in this event loop)."""
        semaphore = self._semaphore()
        return any(slot.held and slot.semaphore is semaphore for slot in _HELD_SLOTS.get())

    async def run(self, code: str) -> SandboxResult:
        """Run `code` in a fresh process and work dir; waits for a slot when `max_concurrent` are running, unless
        the caller holds one (a second wait would deadlock with one slot)."""
        if self.holds_slot():
            return await self.run_in_slot(code)
        async with self.slot():
            return await self.run_in_slot(code)

    async def run_in_slot(self, code: str) -> SandboxResult:
        """`run` for a caller that holds a `slot()` already."""
        work = Path(tempfile.mkdtemp(prefix="rlpipe-sandbox-", dir=self.config.work_root))
        try:
            return await self._run_in(work, code)
        finally:
            shutil.rmtree(work, onerror=_make_removable)

    async def _run_in(self, work: Path, code: str) -> SandboxResult:
        (work / "main.py").write_text(code, encoding="utf-8")
        uid = self.config.run_as_uid
        if uid is not None:
            for path in (work, work / "main.py"):
                os.chown(path, uid, uid)
        start = time.monotonic()
        process = await asyncio.create_subprocess_exec(
            *self._command(), cwd=work, env={"HOME": str(work), "TMPDIR": str(work), "LC_ALL": "C.UTF-8"},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=functools.partial(_set_limits, self._limits()),
            user=uid, group=uid, extra_groups=[] if uid is not None else None,
        )
        try:
            output, truncated, timed_out, over_disk = await self._collect(process, start, work)
        except BaseException:  # cancelled (the caller's timeout): kill now, nothing may be awaited any more
            _kill_group(process)
            _close(process)
            raise
        _kill_group(process)  # leftovers, and the process itself after a timeout or truncation
        await _drain(process)  # before wait(): asyncio's wait() also waits for the pipe to close
        exit_code = await asyncio.wait_for(process.wait(), KILL_WAIT_S)
        text = output.decode("utf-8", errors="replace")
        return SandboxResult(text, exit_code, timed_out, truncated, time.monotonic() - start, over_disk)

    async def _collect(self, process: asyncio.subprocess.Process, start: float,
                       work: Path) -> tuple[bytes, bool, bool, bool]:
        """(output, truncated, timed out, over disk): read until EOF and exit, the byte cap, the work dir's size
        cap, or the deadline."""
        chunks: list[bytes] = []
        limit = self.config.output_bytes

        async def read_until_exit() -> bool:
            size = 0
            assert process.stdout is not None
            while chunk := await process.stdout.read(CHUNK_BYTES):
                if size + len(chunk) > limit:
                    chunks.append(chunk[: limit - size])
                    return True
                chunks.append(chunk)
                size += len(chunk)
            await process.wait()  # EOF comes first when the code closes stdout and keeps running
            return False

        async def disk_full() -> None:
            while await asyncio.to_thread(_tree_bytes, work) <= self.config.disk_mb * 2**20:
                await asyncio.sleep(DISK_POLL_S)

        remaining = self.config.timeout_s - (time.monotonic() - start)
        reader, watcher = asyncio.ensure_future(read_until_exit()), asyncio.ensure_future(disk_full())
        try:
            done, _ = await asyncio.wait({reader, watcher}, timeout=max(remaining, 0.001),
                                        return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, watcher):
                task.cancel()
        output = b"".join(chunks)
        if reader in done:
            return output, reader.result(), False, False
        return output, False, not done, bool(done)


class Slot:
    """`async with`: wait for the semaphore, and mark it held for the code inside (`Sandbox.holds_slot`). A task
    started inside that outlives the block sees the slot as no longer held (`held` is False), and waits for one."""

    def __init__(self, semaphore: asyncio.Semaphore):
        self.semaphore = semaphore
        self.held = False
        self._token: contextvars.Token | None = None

    async def __aenter__(self) -> Slot:
        await self.semaphore.acquire()
        self.held = True
        self._token = _HELD_SLOTS.set((*_HELD_SLOTS.get(), self))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._token is not None, "Slot exited without being entered"
        self.held = False
        _HELD_SLOTS.reset(self._token)
        self.semaphore.release()


def _tree_bytes(root: Path) -> int:
    """Bytes of the files under root (what the code could not read is counted as 0)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the process's group (it is the group leader: start_new_session)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone: the process exited and left nothing behind
        pass


async def _drain(process: asyncio.subprocess.Process) -> None:
    """Read the pipe to EOF (discarding) so that asyncio closes its transport; after a truncation the reader
    stopped early. A writer that escaped the group could hold the pipe open: then close it ourselves."""
    assert process.stdout is not None

    async def discard() -> None:
        while await process.stdout.read(CHUNK_BYTES):
            pass

    try:
        await asyncio.wait_for(discard(), KILL_WAIT_S)
    except TimeoutError:
        logger.warning("python tool: a process outside the sandbox's group holds its output pipe; closing it")
        _close(process)


def _close(process: asyncio.subprocess.Process) -> None:
    """Close asyncio's transport of the process (its pipe), which asyncio has no public method for."""
    process._transport.close()  # type: ignore[attr-defined]


def _make_removable(function: Any, path: str, exc_info: Any) -> None:
    """rmtree's onerror: the code may have left a directory without permissions; open it and retry once."""
    for target in {path, os.path.dirname(path)}:
        if os.path.isdir(target):
            os.chmod(target, 0o700)
    function(path)


def strip_code_fence(code: str) -> str:
    """The code inside one surrounding Markdown fence (```python ... ```), which models often add."""
    match = _FENCE.match(code)
    return match.group(1) if match else code


class PythonTool(BaseTool):
    """The `python` tool: runs `code` in a `Sandbox` and returns its output (see the module docstring)."""

    @classmethod
    def default_schema(cls) -> ToolSchema:
        return ToolSchema(function=ToolFunction(
            name="python",
            description="Run Python 3 code and get what it prints (stdout and stderr). Each call is a new "
                        "process: nothing persists between calls. Standard library only, no network.",
            parameters={
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The program; print what you need."}},
                "required": ["code"],
                "additionalProperties": False,
            },
        ))

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: ToolSchema | dict | None = None):
        super().__init__(config, tool_schema)
        self.sandbox = Sandbox(SandboxConfig.model_validate(self.config))
        self.own_timeout_s = self.sandbox.config.timeout_s + KILL_WAIT_S

    def slot(self) -> Slot:
        return self.sandbox.slot()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolResponse:
        """Runs the code in a `slot()`: the one its caller holds (tools.calls.run_tool_call takes it before the
        call's timeout starts), else one it waits for, so that direct callers keep to `max_concurrent` too."""
        result = await self.sandbox.run(strip_code_fence(str(parameters.get("code", ""))))
        failed = result.timed_out or result.truncated or result.over_disk or bool(result.exit_code)
        metrics = {  # error/timeout: what the loop counts (tool/errors, tool/timeouts): the answer is a note
            "error": float(failed),
            "timeout": float(result.timed_out),
            "sandbox/timeout": float(result.timed_out),
            "sandbox/truncated": float(result.truncated),
            "sandbox/failed": float(result.timed_out or bool(result.exit_code)),
            "sandbox/duration_s": result.duration_s,
        }
        return ToolResponse(text=result.text(self.sandbox.config), metrics=metrics)
