"""Multi-turn RL through the whole flow, with vLLM (CPU build) rollouts and evaluation, on the calculator task:
data prep writes tool rows, SFT learns the call format from conversations, GRPO runs the tool_agent loop with
the real calculator (token in and token out: the trainer's logprobs of the model's tokens match the engine's,
which holds only if the trainer sees exactly the ids the engine generated and the mask covers exactly the
model's tokens), every turn lands in the `turns` table, and evaluation uses the same loop. The second test runs
GRPO with the calculator served by the HTTP tool server (started here on 127.0.0.1) and computed in the
sandboxed Python tool's process. The third runs the RL stage (below the flow: the flow adds nothing that the
interactions touch, evaluation aside) with a simulated user attached at data prep (`data.interaction`) and the
shipped recipes/interactions/gsm8k.yaml, on a model SFT'd to be right about half the time, so that both of the
user's paths run: a right answer ends the conversation, a wrong one gets the user's reply and the model tries
again."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from infra.checkpoints import StoreCheckpoints
from infra.config import load_config
from infra.sql import query
from infra.store import ArtifactStore
from infra.tracking import Tracker
from infra.trajectories import RunTables
from stages.agent.interactions import load_interactions
from stages.rewards import default_compute_score
from stages.rewards.gsm8k import compute_score as gsm8k_score
from tests.integration.test_rl_learning import NoCheckpoints
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


INTERACTIONS = Path(__file__).resolve().parents[2] / "recipes" / "interactions" / "gsm8k.yaml"
MAX_USER_TURNS = 1  # binds before max_assistant_turns: a wrong answer gets one reply, a second wrong one ends it
# One-step sums of 1..3, six of them learned by heart in 60 SFT steps (~20 s): sampled at temperature 1, the first
# answer's `#### N` is right about half the time. 128 response tokens hold two answers and the user's reply.
USER_TASK = [
    "data.synthetic.num_terms=2", "data.synthetic.operators=['+']", "data.synthetic.max_operand=3",
    "data.synthetic.num_train=6", "data.synthetic.num_validation=3", "data.max_response_length=128",
    "data.interaction=gsm8k", "model.tiny.hidden_size=128", "model.tiny.intermediate_size=256", "sft.epochs=60",
    "sft.train_batch_size=6", "sft.micro_batch_size=6", "sft.optim.lr=3e-3", "sft.save_freq=100000",
    "rl.enabled=true", "rl.total_steps=2", "rl.train_batch_size=4", "rl.rollout.n=4", "rl.actor.ppo_mini_batch_size=4",
    "rl.actor.micro_batch_size=16", "rl.test_freq=0", "rl.save_freq=0", "rl.val_before_train=false",
    "rl.max_validation_samples=3", "rl.reward.num_workers=1", "rl.rollout.engine=vllm",
    f"rl.multi_turn.interaction_config_path={INTERACTIONS}", "rl.multi_turn.max_assistant_turns=3",
    f"rl.multi_turn.max_user_turns={MAX_USER_TURNS}"]


def test_simulated_user_in_rl(tmp_path):
    from stages.data_prep import corpus_texts, run_data_prep
    from stages.model.tiny import build_tiny_model
    from stages.rl import run_rl
    from stages.sft import run_sft

    cfg = load_config(None, USER_TASK)
    data = tmp_path / "data"
    run_data_prep(cfg.data, cfg.run.seed, data)
    build_tiny_model(cfg.model.tiny, corpus_texts(data), cfg.run.seed, tmp_path / "base")
    run_sft(cfg, tmp_path / "base", data, tmp_path / "sft", NoCheckpoints(), Tracker([]))
    store = ArtifactStore(str(tmp_path / "store"))
    result = run_rl(cfg, str(tmp_path / "sft"), data, StoreCheckpoints(store, "user", 1), RunTables(store, "user"),
                    Tracker([]))
    assert result.num_steps == 2
    settings = load_interactions(INTERACTIONS)["gsm8k"].settings
    key = "step, group_id, sample_index"
    samples = {(r["step"], r["group_id"], r["sample_index"]): r for r in query(
        store, "SELECT step, group_id, sample_index, data_source, prompt, response, ground_truth, score, "
               "finish_reason FROM rollouts")}
    turns = defaultdict(list)
    for t in query(store, f"SELECT {key}, turn, role, text, num_tokens, score FROM turns ORDER BY {key}, turn"):
        turns[t["step"], t["group_id"], t["sample_index"]].append(t)
    assert len(samples) == 2 * 4 * 4 and set(turns) == set(samples)

    paths, with_reply = defaultdict(int), set()  # with_reply: samples with a user reply in their response
    for sample, conversation in turns.items():
        truth, user_score = samples[sample]["ground_truth"], 0.0
        assert conversation[0]["role"] == "assistant" and len(conversation) <= 2 * (MAX_USER_TURNS + 1)
        for k, t in enumerate(conversation):
            assert t["role"] == ("assistant" if k % 2 == 0 else "user"), conversation  # user turns after each answer
            if t["role"] == "assistant":
                continue
            right = gsm8k_score(conversation[k - 1]["text"], truth) == 1.0  # the user judged the answer before it
            assert (t["text"], t["score"]) == ((settings.correct_text, 1.0) if right else (settings.wrong_text, 0.0))
            user_score += t["score"]
            last = k == len(conversation) - 1
            if right:  # a right answer ends the conversation: recorded, not appended
                assert last and t["num_tokens"] == 0 and samples[sample]["finish_reason"] == "stop", conversation
                paths["right, first answer" if k == 1 else "right after the user's reply"] += 1
            elif not last:  # the reply is appended (mask 0) and the model answers again
                assert t["num_tokens"] > 0, conversation
                paths["wrong, the model tries again"] += 1
            elif samples[sample]["finish_reason"] == "length":  # the reply filled the rest of the response budget
                assert t["num_tokens"] > 0, conversation
            else:  # a wrong answer at the turn limit: the reply is recorded, not appended
                assert t["num_tokens"] == 0 and samples[sample]["finish_reason"] == "max_turns", conversation
                paths["wrong at max_user_turns"] += 1
        appended = [t for t in conversation if t["role"] == "user" and t["num_tokens"] > 0]
        assert len(appended) <= MAX_USER_TURNS, conversation
        if appended:
            with_reply.add(sample)
        # the outcome score: the reward function's on the model's turns + the user's turn scores (weight 1)
        row = samples[sample]
        rule = default_compute_score(row["data_source"], row["response"], truth, {"question": row["prompt"]})
        assert row["score"] == pytest.approx(rule + user_score), (row, conversation)
    print(f"user turns by path: {dict(paths)}")  # shown with pytest -rP
    for path in ("right, first answer", "wrong, the model tries again", "wrong at max_user_turns"):
        assert paths[path], dict(paths)

    # user tokens are in the response with mask 0: the model tokens (mask 1) are exactly the assistant turns'
    tokens = query(store, f"SELECT {key}, r.num_response_tokens AS model, "
                          "sum(t.num_tokens) FILTER (WHERE t.role = 'assistant') AS assistant, "
                          "sum(t.num_tokens) FILTER (WHERE t.role = 'user') AS user "
                          "FROM rollouts r JOIN turns t USING (run_id, step, group_id, sample_index) GROUP BY ALL")
    assert len(tokens) == len(samples) and all(r["model"] == r["assistant"] for r in tokens)
    assert {(r["step"], r["group_id"], r["sample_index"]) for r in tokens if r["user"] > 0} == with_reply
    # the step metrics count the same user turns as the table
    counts = query(store, "SELECT step, count(*) AS turns, count(*) FILTER (WHERE score = 1) AS ends FROM turns "
                          "WHERE role = 'user' GROUP BY 1 ORDER BY 1")
    metrics = {(r["step"], r["name"]): r["value"] for r in query(store, "SELECT step, name, value FROM metrics")}
    for r in counts:
        assert metrics[r["step"], "interaction/turns"] == r["turns"]
        assert metrics[r["step"], "interaction/terminations"] == r["ends"]
        assert metrics[r["step"], "interaction/errors"] == 0
        # token in, token out across user turns: the trainer recomputes the engine's logprobs of the model's tokens
        assert metrics[r["step"], "training/rollout_probs_diff_max"] < 1e-3
    assert [r["step"] for r in counts] == [1, 2]
