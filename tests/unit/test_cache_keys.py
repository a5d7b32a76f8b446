"""Cache keys cover content (tasks/stages.py): replacing a file behind the same path - a data file, a reward
function, a local model folder - changes the key of every stage that reads it, and nothing else's."""

from __future__ import annotations

import os

from infra.config import load_config
from tasks import stages


def keys(cfg, model: str) -> dict[str, str]:
    """The cache key of each stage as Prefect computes it (the tasks' cache_key_fn)."""
    params = {"cfg": cfg, "dataset": "dataset/file@0123456789abcdef", "base_model": model, "init_model": model,
              "model": model, "checkpoint": "checkpoint/rl-x@0123456789abcdef"}
    tasks = {"data": stages.data_prep_task, "base": stages.base_model_task, "sft": stages.sft_task,
             "rl": stages.rl_task, "eval": stages.evaluate_task}
    return {name: task.cache_key_fn(None, params) for name, task in tasks.items()}


def touch_later(path):
    """Another mtime, so a cached digest of the old bytes cannot be reused by accident."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def test_replacing_a_file_changes_the_keys_of_the_stages_that_read_it(tmp_path):
    data, reward, model = tmp_path / "data.jsonl", tmp_path / "reward.py", tmp_path / "model"
    tools, functions = tmp_path / "tools.yaml", tmp_path / "my_tools.py"
    interactions = tmp_path / "interactions.yaml"
    tools.write_text("tools: []\n")
    interactions.write_text("interaction: []\n")
    functions.write_text("def lookup(key: str) -> str:\n    return key\n")
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    reward.write_text("def compute_score(*a):\n    return 1.0\n")
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = load_config(None, ["data.source=file", f"data.path={data}", f"rl.reward.custom_path={reward}",
                             f"model.path={model}", f"rl.multi_turn.tool_config_path={tools}",
                             f"rl.multi_turn.tool_functions=['{functions}:lookup']",
                             f"rl.multi_turn.interaction_config_path={interactions}"])
    before = keys(cfg, str(model))
    assert keys(cfg, str(model)) == before  # stable

    data.write_text('{"question": "2+2?", "answer": "#### 4"}\n')
    touch_later(data)
    after_data = keys(cfg, str(model))
    assert after_data["data"] != before["data"]
    assert {k for k in before if before[k] != after_data[k]} == {"data"}

    reward.write_text("def compute_score(*a):\n    return 0.0\n")
    touch_later(reward)
    after_reward = keys(cfg, str(model))
    assert {k for k in before if after_data[k] != after_reward[k]} == {"rl", "eval"}

    (model / "config.json").write_text('{"hidden_size": 8}')
    touch_later(model / "config.json")
    after_model = keys(cfg, str(model))
    assert {k for k in before if after_reward[k] != after_model[k]} == {"base", "sft", "rl", "eval"}

    changes = ((tools, "tools: []\n# changed\n"), (functions, "def lookup(key: str) -> str:\n    return ''\n"),
               (interactions, "interaction: []\n# changed\n"))
    for tool_file, text in changes:
        previous = keys(cfg, str(model))
        tool_file.write_text(text)
        touch_later(tool_file)
        assert {k for k, v in keys(cfg, str(model)).items() if v != previous[k]} == {"rl", "eval"}, tool_file


def test_hub_ids_and_artifact_refs_are_taken_as_they_are():
    assert stages.content_digest("Qwen/Qwen2.5-0.5B-Instruct") is None
    assert stages._input_identity("model/sft@0123456789abcdef") == "model/sft@0123456789abcdef"


def test_the_math_scorer_is_part_of_the_rl_and_eval_keys(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    verl = keys(load_config(None, [f"model.path={model}"]), str(model))
    math_verify = keys(load_config(None, [f"model.path={model}", "rl.reward.math_scorer=math_verify"]), str(model))
    assert {k for k in verl if verl[k] != math_verify[k]} == {"rl", "eval"}
