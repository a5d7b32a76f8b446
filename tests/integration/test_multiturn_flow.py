"""Multi-turn RL through the whole flow, with vLLM (CPU build) rollouts and evaluation, on the calculator task:
data prep writes tool rows, SFT learns the call format from conversations, GRPO runs the tool_agent loop with
the real calculator (token in and token out: the trainer's logprobs of the model's tokens match the engine's,
which holds only if the trainer sees exactly the ids the engine generated and the mask covers exactly the
model's tokens), every turn lands in the `turns` table, and evaluation uses the same loop. The second test runs
GRPO with the calculator served by the HTTP tool server (started here on 127.0.0.1) and computed in the
sandboxed Python tool's process."""

from __future__ import annotations

import json

import pytest

from infra.sql import query
from tests.integration.test_tool_server import ToolServer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

TOOL_TASK = [
    "data.synthetic.num_train=256", "data.synthetic.num_validation=16", "data.synthetic.num_terms=2",
    "data.synthetic.max_operand=99", "data.synthetic.operators=['*']", "data.synthetic.tool_call_fraction=1.0",
    "data.max_prompt_length=48", "data.max_response_length=96", "model.tiny.hidden_size=128",
    "model.tiny.intermediate_size=256", "sft.epochs=8", "sft.train_batch_size=16", "sft.micro_batch_size=16",
    "sft.optim.lr=2e-3", "rl.enabled=true", "rl.train_batch_size=4", "rl.rollout.n=4",
    "rl.actor.ppo_mini_batch_size=4", "rl.actor.micro_batch_size=16", "rl.test_freq=2", "rl.save_freq=1",
    "rl.max_validation_samples=8", "rl.reward.num_workers=1", "rl.rollout.engine=vllm", "evaluate.engine=vllm",
    "evaluate.max_samples=8", "rl.multi_turn.tool_config_path=recipes/tools/calculator.yaml",
    "rl.multi_turn.max_assistant_turns=3", "rl.multi_turn.max_user_turns=2", "tracking.backends=[jsonl]"]


def test_tool_agent_through_the_flow(tmp_path):
    from flows.post_train import post_train

    root = str(tmp_path / "store")
    common = [*TOOL_TASK, f"storage.root={root}", f"run.output_dir={tmp_path / 'out'}"]
    first = post_train(None, [*common, "rl.total_steps=2"])
    assert first["stages"]["rl"] == "Completed" and first["stages"]["evaluate-rl"] == "Completed"

    turns = query(root, "SELECT role, count(*) AS n, count(DISTINCT step) AS steps FROM turns GROUP BY 1 ORDER BY 1")
    by_role = {r["role"]: r for r in turns}
    assert by_role["assistant"]["steps"] == 2 and by_role["assistant"]["n"] >= 2 * 16
    assert "tool" in by_role, "the SFT model (trained on calls only) never called the tool"
    calls = query(root, "SELECT tool_name, arguments, text, error FROM turns WHERE role = 'tool' AND NOT error")
    assert all(r["tool_name"] == "calculator" and "expression" in r["arguments"] for r in calls)
    rows = query(root, "SELECT step, count(*) AS n, max(num_turns) AS turns, sum(num_tool_calls) AS calls "
                       "FROM rollouts GROUP BY 1 ORDER BY 1")
    assert [(r["step"], r["n"]) for r in rows] == [(1, 16), (2, 16)] and max(r["turns"] for r in rows) >= 2
    metrics = {r["name"]: r["value"] for r in query(root, "SELECT name, value FROM metrics WHERE step = 2")}
    assert metrics["tool/calls"] == rows[1]["calls"] and metrics["num_turns/mean"] >= 1
    # token in, token out: the trainer recomputes the engine's logprobs on the model's tokens only
    assert metrics["training/rollout_probs_diff_max"] < 1e-3, metrics["training/rollout_probs_diff_max"]



SANDBOX_CALCULATOR = """
from stages.tools.sandbox import Sandbox, SandboxConfig

SANDBOX = Sandbox(SandboxConfig(timeout_s=5))


async def calculator(expression: str) -> str:
    \"\"\"Evaluate an arithmetic expression in a sandboxed Python process.

    Args:
        expression: The expression, e.g. '12*(3+4)'.
    \"\"\"
    result = await SANDBOX.run(f"print({expression})")
    return result.text(SANDBOX.config).strip()
"""
REMOTE_TOOLS = """
tools:
  - class_name: stages.tools.remote.RemoteTool
    config: {{url: "{url}", timeout_s: 20, max_attempts: 3}}
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluate an arithmetic expression.
        parameters:
          type: object
          properties:
            expression: {{type: string, description: "The expression."}}
          required: [expression]
"""


def test_tool_agent_with_the_tool_server_and_the_sandbox(tmp_path):
    from flows.post_train import post_train

    (tmp_path / "server").mkdir()
    server = ToolServer(tmp_path / "server", call_timeout_s=10, files={
        "sandbox_calculator.py": SANDBOX_CALCULATOR,
        "tools.yaml": "tools:\n  - class_name: sandbox_calculator.py:calculator\n"}).start()
    tools, root = tmp_path / "remote_tools.yaml", str(tmp_path / "store")
    try:
        tools.write_text(REMOTE_TOOLS.format(url=server.url))
        result = post_train(None, [*TOOL_TASK, f"storage.root={root}", f"run.output_dir={tmp_path / 'out'}",
                                   "rl.total_steps=1", f"rl.multi_turn.tool_config_path={tools}",
                                   "rl.val_before_train=false", "evaluate.max_samples=4"])
    finally:
        server.stop()
    assert result["stages"]["rl"] == "Completed"
    calls = query(root, "SELECT arguments, text, error FROM turns WHERE role = 'tool' AND tool_name = 'calculator'")
    assert calls, "no tool call reached the server"
    good = [c for c in calls if not c["error"] and c["text"].lstrip("-").isdigit()]
    assert good, calls[:3]
    expression = json.loads(good[0]["arguments"])["expression"]  # computed in the sandbox, answered over HTTP
    assert set(expression) <= set("0123456789 *") and int(good[0]["text"]) == eval(expression)  # noqa: S307
