"""The calculator task end to end below the flow: data prep writes tool rows (agent_name, tools_kwargs, SFT
conversations), SFT's token layout of a conversation is exactly the tool_agent loop's layout of the same turns,
and the task's reward scores the model's turns."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from infra.config import load_config
from stages.data_prep import corpus_texts, load_prompts, run_data_prep
from stages.model.tiny import build_tiny_model
from stages.rewards import default_compute_score
from stages.sft_data import tokenize_sft
from tests.unit.test_tool_loop import run

TOOL = ["data.synthetic.tool_call_fraction=0.5", "data.synthetic.num_terms=2", "data.synthetic.operators=['*']",
        "data.synthetic.max_operand=999", "data.synthetic.num_train=64", "data.synthetic.num_validation=16",
        "data.max_response_length=128", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    cfg = load_config(None, TOOL)
    out = tmp_path_factory.mktemp("tool-data")
    run_data_prep(cfg.data, 0, out)
    from stages.model.loading import load_tokenizer

    model_dir = build_tiny_model(cfg.model.tiny, corpus_texts(out), 0, tmp_path_factory.mktemp("tool-model"))
    return cfg, out, load_tokenizer(model_dir)


def test_rows_name_their_loop_and_tool_arguments(task):
    cfg, out, tokenizer = task
    rows = pq.read_table(out / "train.parquet").to_pylist()
    assert {r["agent_name"] for r in rows} == {"tool_agent"}
    assert {r["data_source"] for r in rows} == {"synthetic/calculator"}
    first = rows[0]
    assert first["extra_info"]["tools_kwargs"] == {
        "calculator": {"create_kwargs": {"ground_truth": first["reward_model"]["ground_truth"]}}}
    prompts = load_prompts(out / "train.parquet", tokenizer, cfg.data)
    assert set(prompts.agent_names) == {"tool_agent"}
    sft = pq.read_table(out / "sft_train.parquet").to_pylist()
    with_call = [r for r in sft if r["turns"]]
    assert len(with_call) == 32 and [m["role"] for m in with_call[0]["turns"]] == ["assistant", "tool", "assistant"]
    assert all(r["response"].startswith("#### ") for r in sft)


TOOLS_TEMPLATE = (  # Qwen2.5's way: the tool schemas in a system block before the messages
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n' }}{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_tool_agent_prompts_and_multi_turn_sft_prompts_show_the_tools(task, tmp_path):
    """As verl's tool agent loop (apply_chat_template(tools=...)): a model whose template renders tools reads their
    schemas in RL's tool_agent prompts, and SFT's rows of the task, with a tool call or without, have the same
    prompts; rows of another loop do not."""
    import copy

    from stages.agent.rollout import load_rollout_tools, tool_schemas

    cfg, out, tokenizer = task
    data = cfg.data.model_copy(update={"max_prompt_length": 1024})  # the schema's JSON is a few hundred tokens
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    schemas = tool_schemas(load_rollout_tools(load_config("recipes/tool_calc.yaml").rl.multi_turn))
    assert [s["function"]["name"] for s in schemas] == ["calculator"]
    prompts = load_prompts(out / "train.parquet", tokenizer, data, schemas)
    text = tokenizer.decode(prompts.prompt_ids[0])
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "calculator"' in text
    plain = pq.read_table(out / "train.parquet").to_pylist()[:1]
    plain[0]["agent_name"] = "single_turn"
    pq.write_table(pa.Table.from_pylist(plain), tmp_path / "single.parquet")
    assert "# Tools" not in tokenizer.decode(load_prompts(tmp_path / "single.parquet", tokenizer, data,
                                                          schemas).prompt_ids[0])
    sft = pq.read_table(out / "sft_train.parquet").to_pylist()
    examples = tokenize_sft(out / "sft_train.parquet", tokenizer, data, schemas)
    multi, direct = (next(k for k, r in enumerate(sft) if bool(r["turns"]) == want) for want in (True, False))
    for k in (multi, direct):  # the direct answers too: RL's prompt of the same question shows the tools
        prompt = tokenizer.decode(examples[k].input_ids[:examples[k].num_prompt_tokens])
        assert prompt == tokenizer.decode(prompts.prompt_ids[0]).replace(sft[0]["prompt"][-1]["content"],
                                                                         sft[k]["prompt"][-1]["content"])
    other = [{**row, "agent_name": "single_turn"} for row in sft[:2]]
    pq.write_table(pa.Table.from_pylist(other), tmp_path / "sft_single.parquet")
    single = tokenize_sft(tmp_path / "sft_single.parquet", tokenizer, data, schemas)
    assert "# Tools" not in tokenizer.decode(single[0].input_ids)


def test_sft_layout_is_the_loops_layout(task):
    cfg, out, tokenizer = task
    sft = pq.read_table(out / "sft_train.parquet").to_pylist()
    examples = tokenize_sft(out / "sft_train.parquet", tokenizer, cfg.data)
    i = next(k for k, r in enumerate(sft) if r["turns"])
    turns = sft[i]["turns"]
    # the loop, scripted to say the same assistant texts, with the real calculator answering
    [t], _, prompts = run(tokenizer, {0: [turns[0]["content"], turns[2]["content"]]}, max_tokens=500)
    assert t.turns[1]["text"] == turns[1]["content"]  # the real tool gave the SFT row's answer
    example = examples[i]
    assert example.input_ids[example.num_prompt_tokens:] == t.response_ids
    assert example.loss_mask == t.response_mask
    direct = next(k for k, r in enumerate(sft) if not r["turns"])
    assert examples[direct].loss_mask is None


def test_the_reward_scores_the_final_answer_after_the_call(task):
    cfg, out, _ = task
    row = pq.read_table(out / "train.parquet").to_pylist()[0]
    truth = row["reward_model"]["ground_truth"]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 * 1"}}</tool_call>'
    assert default_compute_score("synthetic/calculator", f"{call}\n#### {truth}", truth, None) == 1.0
    assert default_compute_score("synthetic/calculator", f"{call}\n#### {int(truth) + 1}", truth, None) == 0.0
    assert default_compute_score("synthetic/calculator", call, truth, None) == 0.0
