"""The tool server as a real process (`python -m stages.tools.server` on 127.0.0.1) and RemoteTool against it:
listing, the lifecycle, server- and client-side timeouts (an execute is never retried), HTTP errors, a dead
server (error text after bounded retries) and a restart that the retries ride through."""

from __future__ import annotations

import asyncio
import logging
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.tools.base import ToolCall
from stages.tools.calculator import CalculatorTool
from stages.tools.calls import run_tool_call
from stages.tools.remote import RemoteTool, ToolServerError, remote_tools
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 30  # imports on a busy 2-core machine; the start itself takes well under a second

USER_TOOLS = '''
import asyncio

from stages.tools.base import BaseTool, ToolFunction, ToolResponse, ToolSchema

CALLS = {"sleepy": 0}


async def sleepy(seconds: float) -> str:
    """Sleep, then answer."""
    CALLS["sleepy"] += 1
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


def sleepy_calls() -> str:
    """How many times sleepy was called."""
    return str(CALLS["sleepy"])


class Scorer(BaseTool):
    """Rewards the answer that matches the instance's ground truth."""

    @classmethod
    def default_schema(cls):
        parameters = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
        return ToolSchema(function=ToolFunction(name="score", parameters=parameters))

    async def execute(self, instance_id, parameters, **kwargs):
        state = self.instances[instance_id]
        reward = float(parameters["answer"] == state["create_kwargs"]["ground_truth"])
        state["reward"] = reward
        return ToolResponse("correct" if reward else "wrong", reward)
'''

TOOLS_YAML = """
tools:
  - class_name: stages.tools.calculator.CalculatorTool
  - class_name: user_tools.py:sleepy
  - class_name: user_tools.py:sleepy_calls
  - class_name: user_tools.py:Scorer
"""


class ToolServer:
    """`python -m stages.tools.server` in a subprocess; `url` once it prints its address."""

    def __init__(self, folder: Path, port: int = 0, call_timeout_s: float = 0.5, files: dict[str, str] | None = None):
        """files: name -> text written into `folder` (default: this module's user_tools.py and tools.yaml)."""
        for name, text in (files or {"user_tools.py": USER_TOOLS, "tools.yaml": TOOLS_YAML}).items():
            (folder / name).write_text(text)
        self.folder, self.port, self.call_timeout_s = folder, port, call_timeout_s
        self.process: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> ToolServer:
        command = [sys.executable, "-m", "stages.tools.server", "--tools", str(self.folder / "tools.yaml"),
                   "--port", str(self.port), "--call-timeout-s", str(self.call_timeout_s)]
        with open(self.folder / "server.log", "ab") as log:
            self.process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True)
        ready, _, _ = select.select([self.process.stdout], [], [], START_TIMEOUT_S)
        line = self.process.stdout.readline() if ready else ""
        if not line.startswith("serving "):
            self.stop()
            raise RuntimeError(f"tool server did not start: {line!r}; log: {(self.folder / 'server.log').read_text()}")
        self.url = line.split(" on ")[1].strip()
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None:
            self.process.stdout.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ToolServer(tmp_path_factory.mktemp("tool-server")).start()
    yield server
    server.stop()


def run(coro):
    return asyncio.run(coro)


def test_list_tools(server):
    tools = remote_tools(server.url)
    assert list(tools) == ["calculator", "sleepy", "sleepy_calls", "score"]
    assert tools["calculator"].schema == CalculatorTool().schema
    assert tools["sleepy"].schema.function.parameters["required"] == ["seconds"]
    assert tools["calculator"].remote.url == server.url


def test_execute_and_errors_as_text(server):
    calculator = remote_tools(server.url)["calculator"]
    response = run(run_tool_call(calculator, "i", ToolCall("calculator", {"expression": "12*7"}), 5))
    assert response.text == "84" and response.metrics["error"] == 0.0
    assert response.metrics["calculator/error"] == 0.0  # the server's metrics come through
    response = run(calculator.execute("i", {"expr": "1"}))  # validated by the server's run_tool_call
    assert response.text.startswith("error: tool 'calculator': missing required argument 'expression'")
    assert response.metrics["error"] == 1.0


def test_lifecycle(server):
    score = remote_tools(server.url)["score"]

    async def scenario():
        instance = await score.create(ground_truth="42")
        wrong = await score.execute(instance, {"answer": "41"})
        right = await score.execute(instance, {"answer": "42"})
        reward = await score.calc_reward(instance)
        await score.release(instance)
        return wrong, right, reward

    wrong, right, reward = run(scenario())
    assert (wrong.text, wrong.reward, right.text, right.reward, reward) == ("wrong", 0.0, "correct", 1.0, 1.0)


def test_hanging_tool_times_out_on_the_server(server):
    sleepy = remote_tools(server.url)["sleepy"]
    response = run(sleepy.execute("i", {"seconds": 60}))
    assert response.text == "error: tool 'sleepy' timed out after 0.5 s"  # --call-timeout-s 0.5
    assert response.metrics["timeout"] == 1.0 and response.metrics["error"] == 1.0


def test_client_timeout_is_text_and_execute_is_not_retried(server):
    tools = remote_tools(server.url, timeout_s=0.2, max_attempts=5)
    before = int(run(tools["sleepy_calls"].execute("i", {})).text)
    response = run(tools["sleepy"].execute("i", {"seconds": 0.4}))
    assert response.text.startswith("error: remote tool 'sleepy' timed out (")
    assert response.text.endswith("it may or may not have run")
    assert response.metrics == {"error": 1.0, "timeout": 1.0}
    time.sleep(0.5)
    assert int(run(tools["sleepy_calls"].execute("i", {})).text) == before + 1  # one call, no retry


def test_the_loops_timeout_waits_for_the_remote_calls_own_deadline(server):
    """A call that waits in the server's queue is cut by the request's deadline (its own timeout text), not by a
    shorter tool_timeout_s of the loop: run_tool_call gives a remote tool at least its deadline."""
    from stages.tools.base import ToolCall
    from stages.tools.calls import run_tool_call

    sleepy = remote_tools(server.url, timeout_s=2.0, max_attempts=1)["sleepy"]
    assert sleepy.own_timeout_s == 2.0
    response = run(run_tool_call(sleepy, "i", ToolCall("sleepy", {"seconds": 0.3}), timeout_s=0.1))
    assert response.metrics["error"] == 0.0 and response.metrics["latency_s"] >= 0.3


def test_http_errors(server):
    ghost = RemoteTool({"url": server.url, "max_attempts": 2, "backoff_s": 0.01},
                       {"function": {"name": "ghost"}})
    response = run(ghost.execute("i", {}))
    assert response.text.startswith("error: remote tool 'ghost': ")
    assert "HTTP 404: unknown tool 'ghost'; this server has: calculator, score, sleepy, sleepy_calls" in response.text
    with pytest.raises(ToolServerError, match="HTTP 404"):
        run(ghost.create())


def test_dead_server_gives_error_text_after_bounded_retries(tmp_path, caplog):
    server = ToolServer(tmp_path).start()
    calculator = remote_tools(server.url, max_attempts=3, backoff_s=0.05)["calculator"]
    server.stop()
    response = run(calculator.execute("i", {"expression": "1+1"}))
    assert response.text.startswith(f"error: remote tool 'calculator': tool server {server.url} did not answer "
                                    "execute after 3 attempts (last: ClientConnectorError")
    assert response.metrics == {"error": 1.0, "timeout": 0.0}
    with pytest.raises(ToolServerError, match="did not answer create after 3 attempts"):
        run(calculator.create())
    with caplog.at_level(logging.WARNING, logger="stages.tools.remote"):
        run(calculator.release("i"))  # logs, does not raise
    assert "release of i failed" in caplog.text
    with pytest.raises(ToolServerError, match="did not answer GET /tools after 2 attempts"):
        remote_tools(server.url, max_attempts=2, backoff_s=0.01)


def test_retries_ride_through_a_restart(tmp_path):
    server = ToolServer(tmp_path, port=free_port()).start()
    calculator = remote_tools(server.url, max_attempts=20, backoff_s=0.1, max_backoff_s=0.5)["calculator"]
    server.stop()

    async def call_while_restarting():
        call = asyncio.create_task(calculator.execute("i", {"expression": "6*7"}))
        await asyncio.sleep(0.3)
        assert not call.done()  # still retrying against the dead port
        await asyncio.to_thread(server.start)
        return await call

    try:
        response = run(call_while_restarting())
    finally:
        server.stop()
    assert response.text == "42" and response.metrics["error"] == 0.0


def test_server_refuses_a_bad_tools_file(tmp_path):
    (tmp_path / "tools.yaml").write_text("tools:\n  - class_name: nowhere.Tool\n")
    done = subprocess.run([sys.executable, "-m", "stages.tools.server", "--tools", str(tmp_path / "tools.yaml")],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "tools[0]: cannot import module 'nowhere'" in done.stderr


def test_calculator_tool_text_is_unchanged_by_the_trip(server):
    expressions = ["2**10", "7/2", "1/0", "2^3"]
    remote = remote_tools(server.url)["calculator"]
    local = CalculatorTool()

    async def both(expression):
        return (await remote.execute("i", {"expression": expression})).text, \
            (await local.execute("i", {"expression": expression})).text

    for expression in expressions:
        remote_text, local_text = run(both(expression))
        assert remote_text == local_text, expression
