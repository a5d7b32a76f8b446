"""What a config names outside itself is checked before the flow starts (flows.post_train.preflight): the store,
local model and data paths, the reward function; each error names its field, and nothing is written."""

from __future__ import annotations

import pytest

from flows.post_train import main, preflight
from infra.config import ConfigError, load_config


@pytest.fixture
def store(tmp_path):
    return f"storage.root={tmp_path / 'store'}"


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.path=/nonexistent/model"], "model.path=/nonexistent/model: no such file or folder"),
    (["data.source=file", "data.path=./no/such.jsonl"], "data.path=./no/such.jsonl: no such file or folder"),
    (["rl.enabled=true", "rl.reward.custom_path=/nonexistent/r.py"],
     "rl.reward.custom_path=/nonexistent/r.py: custom reward file '/nonexistent/r.py' not found"),
])
def test_a_missing_file_is_named_before_anything_runs(store, overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        preflight(load_config(None, [store, *overrides]))


def test_a_reward_function_that_is_not_in_its_file(store, tmp_path):
    (tmp_path / "r.py").write_text("def other(data_source, solution_str, ground_truth, extra_info=None):\n"
                                   "    return 0.0\n")
    cfg = load_config(None, [store, "rl.enabled=true", f"rl.reward.custom_path={tmp_path / 'r.py'}"])
    with pytest.raises(ConfigError, match=r"rl\.reward\.custom_path=.*r\.py: .*compute_score"):
        preflight(cfg)


def test_a_hub_id_and_the_defaults_pass(store, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the tests' environment sets it
    preflight(load_config(None, [store, "model.path=Qwen/Qwen2.5-0.5B-Instruct"]))


@pytest.mark.parametrize("field", ["model.path", "rl.reward.reward_model_path"])
def test_a_model_path_that_is_neither_a_folder_nor_a_hub_id(store, field):
    """'models/qwen/v2' (a relative folder that is not there) went to the hub, which refused it after data prep."""
    with pytest.raises(ConfigError, match=rf"{field}=models/qwen/v2: no such local folder, and not a hub id"):
        preflight(load_config(None, [store, "rl.enabled=true", f"{field}=models/qwen/v2"]))


def test_offline_a_hub_id_must_be_in_the_local_cache(store, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match=r"model\.path=Qwen/Qwen2\.5-0\.5B: HF_HUB_OFFLINE is set and the local"):
        preflight(load_config(None, [store, "model.path=Qwen/Qwen2.5-0.5B"]))
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc")
    preflight(load_config(None, [store, "model.path=Qwen/Qwen2.5-0.5B"]))  # cached: passes


def test_an_unwritable_store_exits_2_and_writes_no_run_folder(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the store's folder would go
    assert main([f"storage.root={blocked / 'store'}", f"run.output_dir={tmp_path / 'out'}"]) == 2
    assert capsys.readouterr().err.startswith(f"error: storage.root={blocked / 'store'}: cannot create")
    assert not (tmp_path / "out").exists()
