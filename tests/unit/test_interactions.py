"""Simulated users (stages/agent/interactions.py) in the `tool_agent` loop, with the real tiny tokenizer, chat template,
calculator and GSM8K interaction; the engine is scripted (tests/unit/test_tool_loop.py `Script`), so that each
trajectory's layout can be checked by hand."""

from __future__ import annotations

import asyncio
import copy
import logging

import pytest

from infra.rl_config import MultiTurnConfig
from stages.agent import LoopContext, Sample, ToolAgentLoop
from stages.agent.interactions import Gsm8kInteraction, Interaction, load_interactions, pick_interaction
from stages.agent.rollout import load_rollout_interactions
from stages.model.loading import load_tokenizer, user_turn_ids
from stages.rollout.base import SamplingParams
from stages.tools.calculator import CalculatorTool
from tests.unit.test_tool_loop import CALL, Script

WRONG = Gsm8kInteraction().settings.wrong_text
RIGHT = Gsm8kInteraction().settings.correct_text


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


class Recording(Gsm8kInteraction):
    """The GSM8K interaction, recording what the loop passes to it."""

    def __init__(self, config=None):
        super().__init__(config)
        self.calls: list[tuple] = []

    async def start_interaction(self, instance_id=None, **kwargs):
        self.calls.append(("start", instance_id, kwargs))
        return await super().start_interaction(instance_id, **kwargs)

    async def generate_response(self, instance_id, messages, **kwargs):
        self.calls.append(("respond", instance_id, [dict(m) for m in messages]))
        return await super().generate_response(instance_id, messages, **kwargs)

    async def finalize_interaction(self, instance_id, **kwargs):
        self.calls.append(("finalize", instance_id, kwargs))
        await super().finalize_interaction(instance_id, **kwargs)


def run(tokenizer, scripts: dict[int, list[str]], interactions: dict, kwargs: dict[int, dict | None],
        max_tokens=300, **options):
    """Each sample k: the prompt 'question k', extra_info.interaction_kwargs = kwargs[k]."""
    prompts = {k: [1000 + k] + tokenizer(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"question {k}"}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)["input_ids"] for k in scripts}
    script = Script(tokenizer, scripts, {k: ids[0] for k, ids in prompts.items()})
    ctx = LoopContext(script, tokenizer, SamplingParams(n=1, max_tokens=max_tokens, seed=3),
                      {"calculator": CalculatorTool()}, MultiTurnConfig(**options), interactions)
    samples = [Sample(k, prompts[k], [{"role": "user", "content": f"question {k}"}],
                      {"index": k, "interaction_kwargs": kwargs[k]}) for k in scripts]
    return ToolAgentLoop().run_batch(ctx, samples), script, prompts


def alternating(tokenizer):
    """The tokenizer with a Gemma-style template, which refuses two user turns in a row."""
    other = copy.deepcopy(tokenizer)
    other.chat_template = (
        "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
    return other


def thinking(tokenizer):
    """The tokenizer with Qwen3's rule for assistant turns (the rest ChatML): the last assistant turn after the last
    user query gets an empty think block, earlier ones do not. So [user, assistant] renders the assistant turn
    differently once a user turn follows it."""
    other = copy.deepcopy(tokenizer)
    other.chat_template = (
        "{%- set ns = namespace(last_query=messages|length - 1) %}"
        "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}"
        "{%- endif %}{%- endfor %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'assistant' and loop.index0 > ns.last_query and loop.last %}"
        "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message.content + '<|im_end|>\n' }}"
        "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
    return other


def test_user_turn_ids_with_a_template_that_rerenders_the_last_assistant_turn(tokenizer):
    # Qwen3's template: a probe rendered after [user, assistant] is no prefix of itself plus a user turn; the user
    # turn is rendered after a user turn instead, as tool messages are (and verl's delta is)
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert user_turn_ids(thinking(tokenizer), WRONG) == ids(
        f"\n<|im_start|>user\n{WRONG}<|im_end|>\n<|im_start|>assistant\n")


def test_model_user_model_layout_by_hand(tokenizer):
    """model turn (wrong) | user reply | model turn (right): the right answer ends the conversation."""
    user = Recording({"name": "gsm8k"})
    kwargs = {"name": "gsm8k", "ground_truth": "85"}
    [t], script, prompts = run(tokenizer, {0: ["#### 84", "#### 85"]}, {"gsm8k": user}, {0: kwargs},
                               interaction_reward_weight=2.0)
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tokenizer.eos_token_id
    turn1, turn2 = ids("#### 84") + [eos], ids("#### 85") + [eos]
    reply = ids(f"\n<|im_start|>user\n{WRONG}<|im_end|>\n<|im_start|>assistant\n")
    assert user_turn_ids(tokenizer, WRONG) == reply
    assert user_turn_ids(alternating(tokenizer), WRONG) == ids(f"<start_of_turn>user\n{WRONG}<end_of_turn>\n"
                                                              "<start_of_turn>model\n")
    assert t.response_ids == turn1 + reply + turn2
    assert t.response_mask == [1] * len(turn1) + [0] * len(reply) + [1] * len(turn2)
    assert t.logprobs == [-0.25] * len(turn1) + [0.0] * len(reply) + [-0.25] * len(turn2)
    assert script.seen[0] == [prompts[0], prompts[0] + turn1 + reply]  # token in, token out
    assert t.finish_reason == "stop" and t.num_turns == 2 and t.text == "#### 84\n#### 85"
    # the reply that ended it is recorded, not appended (no model turn follows it)
    assert [(r["role"], r["text"], r["tokens"], r.get("score")) for r in t.turns] == [
        ("assistant", "#### 84", len(turn1), None), ("user", WRONG, len(reply), 0.0),
        ("assistant", "#### 85", len(turn2), None), ("user", RIGHT, 0, 1.0)]
    assert t.interaction_reward == 2.0 * (0.0 + 1.0)  # weight x (turn scores)
    assert t.metrics["interaction/turns"] == 2 and t.metrics["interaction/terminations"] == 1
    assert t.metrics["interaction/errors"] == 0
    # verl's calls: start with the row's kwargs, the conversation so far as chat dicts, finalize; one instance id
    (start, id1, start_kwargs), (_, id2, first), (_, id3, second), (end, id4, _) = user.calls
    assert (start, end, start_kwargs) == ("start", "finalize", kwargs) and id1 == id2 == id3 == id4
    question = [{"role": "user", "content": "question 0"}]
    assert first == question + [{"role": "assistant", "content": "#### 84"}]
    assert second == first + [{"role": "user", "content": WRONG}, {"role": "assistant", "content": "#### 85"}]
    assert user.instances == {}  # finalized


def test_right_first_answer_ends_and_adds_to_the_score(tokenizer, tiny_config):
    [t], _, _ = run(tokenizer, {0: ["#### 5"]}, {"gsm8k": Gsm8kInteraction({"name": "gsm8k"})},
                    {0: {"name": "gsm8k", "ground_truth": "5"}}, interaction_reward_weight=2.0)
    eos = tokenizer.eos_token_id
    assert t.response_ids == tokenizer("#### 5", add_special_tokens=False)["input_ids"] + [eos]
    assert set(t.response_mask) == {1} and t.finish_reason == "stop" and t.interaction_reward == 2.0

    from stages.agent import Rollout
    from stages.data_prep import PromptSet
    from stages.rewards.pool import RewardPool
    from stages.rl_data import rollout_batch, turn_rows

    prompts = PromptSet([[1]], [[{"role": "user", "content": "q"}]], ["synthetic/calculator"], ["5"], [{}],
                        ["tool_agent"])
    with RewardPool(tiny_config.rl.reward) as pool:
        scored = Rollout(None, tokenizer, pool).score(prompts, [0], [t])
    assert scored.result.scores == [1.0] and scored.scores == [1.0 + 2.0]  # rule score + weight x turn score
    rows = turn_rows(rollout_batch(prompts, [0], [t], "g", tokenizer.pad_token_id))
    assert [(r["role"], r["score"], r["num_tokens"]) for r in rows] == [("assistant", None, len(t.response_ids)),
                                                                        ("user", 1.0, 0)]


def test_tool_and_user_turns_both_count_against_max_user_turns(tokenizer):
    """call | tool answer (user turn 1) | wrong | user reply (2) | wrong: max_user_turns=2 reached; the interaction
    still judges the last answer (score recorded, reply not appended)."""
    user = {"gsm8k": Gsm8kInteraction({"name": "gsm8k"})}
    kwargs = {0: {"name": "gsm8k", "ground_truth": "7"}}
    [t], _, _ = run(tokenizer, {0: [CALL % "1+1", "#### 2", "#### 3", "#### 7"]}, user, kwargs,
                    max_user_turns=2, max_assistant_turns=10)
    assert t.finish_reason == "max_turns" and t.num_turns == 3
    assert [r["role"] for r in t.turns] == ["assistant", "tool", "assistant", "user", "assistant", "user"]
    assert t.turns[-1]["tokens"] == 0 and t.response_mask[-1] == 1  # ends on the model's end-of-turn token
    assert t.response_ids[-1] == tokenizer.eos_token_id and t.metrics["interaction/turns"] == 2

    [t], _, _ = run(tokenizer, {0: ["#### 1"] * 5}, user, kwargs, max_assistant_turns=2, max_user_turns=10)
    assert t.finish_reason == "max_turns" and t.num_turns == 2
    assert [r["role"] for r in t.turns] == ["assistant", "user", "assistant", "user"]
    assert t.metrics["interaction/turns"] == 2 and t.interaction_reward == 0.0

    [t], _, _ = run(tokenizer, {0: ["#### 1"] * 5}, user, kwargs, max_tokens=20, max_user_turns=10)
    assert t.finish_reason == "length" and len(t.response_ids) == len(t.response_mask) == len(t.logprobs) == 20


class Broken(Interaction):
    """Fails in `how`: raises in start or respond, hangs, or returns three values instead of four."""

    def __init__(self, config=None):
        super().__init__(config)
        self.finalized = 0

    async def start_interaction(self, instance_id=None, **kwargs):
        if self.config["how"] == "start":
            raise RuntimeError("no user today")
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        if self.config["how"] == "hang":
            await asyncio.sleep(60)
        if self.config["how"] == "respond":
            raise KeyError("ground_truth")
        return False, "ok", 0.5  # one value short

    async def finalize_interaction(self, instance_id, **kwargs):
        self.finalized += 1


@pytest.mark.parametrize("how", ["start", "respond", "hang", "three_values"])
def test_a_failing_interaction_ends_its_trajectory_not_the_run(tokenizer, caplog, how):
    broken = Broken({"name": "broken", "how": how})
    users = {"broken": broken, "gsm8k": Gsm8kInteraction({"name": "gsm8k"})}
    kwargs = {0: {"name": "broken"}, 1: {"name": "gsm8k", "ground_truth": "2"}}
    with caplog.at_level(logging.WARNING, logger="stages.agent.interactions"):
        [bad, good], _, _ = run(tokenizer, {0: [CALL % "1+1", "#### 2", "#### 2"], 1: ["#### 1", "#### 2"]}, users,
                                kwargs, interaction_timeout_s=0.2)
    # the broken one's trajectory keeps its turns up to the failure: a tool turn, then the answer it could not judge
    assert bad.finish_reason == "interaction_error" and bad.num_turns == 2 and bad.interaction_reward == 0.0
    assert [r["role"] for r in bad.turns] == ["assistant", "tool", "assistant"]
    assert bad.metrics["interaction/errors"] == 1 and bad.metrics["interaction/timeouts"] == float(how == "hang")
    assert broken.finalized == (0 if how == "start" else 1)  # finalize only what started
    assert good.finish_reason == "stop" and good.interaction_reward == 1.0
    assert "interaction 'broken'" in caplog.text and "interaction_error" in caplog.text


def test_rows_must_name_a_configured_interaction(tokenizer):
    users = {"gsm8k": Gsm8kInteraction({"name": "gsm8k"})}
    with pytest.raises(ValueError, match=r"row index=0: extra_info.interaction_kwargs .* has no `name`"):
        run(tokenizer, {0: ["#### 1"]}, users, {0: {"ground_truth": "1"}})
    with pytest.raises(ValueError, match=r"interaction_kwargs.name='judge' is not configured.*\['gsm8k'\]"):
        run(tokenizer, {0: ["#### 1"]}, users, {0: {"name": "judge"}})
    assert pick_interaction(users, {"index": 3}) is None  # rows without kwargs run without a simulated user
    # keys that only other rows of a parquet file have read back as None: not passed, the interaction's defaults apply
    picked = pick_interaction(users, {"interaction_kwargs": {"name": "gsm8k", "ground_truth": "2", "query": None}})
    assert picked == (users["gsm8k"], {"name": "gsm8k", "ground_truth": "2"})
    assert pick_interaction({}, {"interaction_kwargs": {"name": "gsm8k"}}) is None
    [t], _, _ = run(tokenizer, {0: ["#### 1", "#### 2"]}, {}, {0: {"name": "gsm8k", "ground_truth": "2"}})
    assert t.finish_reason == "stop" and t.num_turns == 1  # none configured: the plain tool loop (and a warning)


def write(tmp_path, text: str):
    path = tmp_path / "interactions.yaml"
    path.write_text(text)
    return path


def test_load_interactions_from_verl_yaml(tmp_path):
    (tmp_path / "judges.py").write_text(
        "from stages.agent.interactions import Interaction\n\n"
        "class PoliteInteraction(Interaction):\n"
        "    async def generate_response(self, instance_id, messages, **kwargs):\n"
        "        return True, 'thanks', 0.0, {}\n")
    path = write(tmp_path, "interaction:\n"
                           "  - name: strict_math\n"
                           "    class_name: stages.agent.interactions.Gsm8kInteraction\n"
                           "    config: {method: flexible}\n"
                           "  - class_name: judges.py:PoliteInteraction\n")
    loaded = load_rollout_interactions(MultiTurnConfig(interaction_config_path=str(path)))
    assert sorted(loaded) == ["polite", "strict_math"]  # verl's default name: class name - "Interaction", lower
    assert loaded["strict_math"].settings.method == "flexible" and loaded["strict_math"].name == "strict_math"
    assert load_rollout_interactions(MultiTurnConfig()) == {}


@pytest.mark.parametrize("text, match", [
    (None, "not found; give rl.multi_turn.interaction_config_path"),
    ("interaction: [", "is not valid YAML"),
    ("tools: []", "non-empty `interaction:` list"),
    ("interaction:\n  - name: a\n", r"interaction\[0\]: `class_name` is missing"),
    ("interaction:\n  - class_name: stages.agent.interactions.Gsm8kInteraction\n    kwargs: {}\n",
     r"interaction\[0\]: unknown keys \['kwargs'\]"),
    ("interaction:\n  - class_name: stages.tools.calculator.CalculatorTool\n",
     "is not a concrete subclass of stages.agent.interactions.Interaction"),
    ("interaction:\n  - class_name: stages.agent.interactions.Interaction\n", "implement generate_response"),
    ("interaction:\n  - class_name: stages.agent.interactions.Nope\n", "has no 'Nope'"),
    ("interaction:\n  - class_name: stages.agent.interactions.Gsm8kInteraction\n    config: {methd: strict}\n",
     r"interaction\[0\] .*invalid config: methd: Extra inputs are not permitted.*fix the entry's `config`"),
    ("interaction:\n  - class_name: stages.agent.interactions.Gsm8kInteraction\n"
     "  - class_name: stages.agent.interactions.Gsm8kInteraction\n",
     r"interaction\[1\]: name 'gsm8k' is already used by .*interaction\[0\]; give one of them another `name`"),
])
def test_bad_interaction_files_are_errors_naming_the_entry_and_fix(tmp_path, text, match):
    path = tmp_path / "missing.yaml" if text is None else write(tmp_path, text)
    with pytest.raises(ValueError, match=match):
        load_interactions(path)


def test_gsm8k_interaction_needs_a_ground_truth():
    with pytest.raises(ValueError, match="interaction_kwargs has no ground_truth"):
        asyncio.run(Gsm8kInteraction().start_interaction("id", name="gsm8k"))


def test_verl_rows_keep_their_agent_name():
    from data.files import verl_example
    from infra.config_sections import ColumnMapping

    row = {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"},
           "agent_name": "tool_agent", "extra_info": {"interaction_kwargs": {"name": "gsm8k", "ground_truth": "2"}}}
    example = verl_example(row, 0, ColumnMapping(), "mine")
    assert example.agent_name == "tool_agent" and example.extra["interaction_kwargs"]["name"] == "gsm8k"
