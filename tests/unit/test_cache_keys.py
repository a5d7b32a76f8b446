"""Cache keys cover content (tasks/cache_keys.py): replacing a file behind the same path - a data file, a reward
function, a local model folder - changes the key of every stage that reads it, and nothing else's. They name the
store as resolved (a relative root from two working directories is two stores), and a cached result whose artifact
the store no longer holds is a miss."""

from __future__ import annotations

import os
from types import SimpleNamespace

from prefect.filesystems import LocalFileSystem
from prefect.results import ResultStore
from prefect.serializers import JSONSerializer

from infra.config import config_hash, load_config
from infra.store import ArtifactStore
from tasks import cache_keys, stages


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

    # the tools' schemas reach SFT's multi-turn prompts too; the interactions only RL's and evaluation's rollouts
    changes = ((tools, "tools: []\n# changed\n", {"sft", "rl", "eval"}),
               (functions, "def lookup(key: str) -> str:\n    return ''\n", {"sft", "rl", "eval"}),
               (interactions, "interaction: []\n# changed\n", {"rl", "eval"}))
    for tool_file, text, stages_reading in changes:
        previous = keys(cfg, str(model))
        tool_file.write_text(text)
        touch_later(tool_file)
        assert {k for k, v in keys(cfg, str(model)).items() if v != previous[k]} == stages_reading, tool_file


def test_hub_ids_and_artifact_refs_are_taken_as_they_are():
    assert cache_keys.content_digest("Qwen/Qwen2.5-0.5B-Instruct") is None
    assert cache_keys._input_identity("model/sft@0123456789abcdef") == "model/sft@0123456789abcdef"


def local_model_keys(tmp_path, *overrides: str) -> dict[str, str]:
    """The stages' keys of a config with a local model folder (`tmp_path`/model) and `overrides`."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return keys(load_config(None, [f"model.path={model}", *overrides]), str(model))


def test_the_math_scorer_is_part_of_the_rl_and_eval_keys(tmp_path):
    verl = local_model_keys(tmp_path)
    math_verify = local_model_keys(tmp_path, "rl.reward.math_scorer=math_verify")
    assert {k for k in verl if verl[k] != math_verify[k]} == {"rl", "eval"}


def test_a_relative_store_root_is_keyed_by_the_folder_it_names(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    relative = load_config(None, ["storage.root=outputs/store"])
    monkeypatch.chdir(first)
    from_first = keys(relative, "Qwen/Qwen2.5-0.5B-Instruct")
    monkeypatch.chdir(second)
    from_second = keys(relative, "Qwen/Qwen2.5-0.5B-Instruct")
    assert all(from_first[k] != from_second[k] for k in from_first)  # two stores: no stage shares a cached result
    absolute = load_config(None, [f"storage.root={first / 'outputs' / 'store'}"])
    assert keys(absolute, "Qwen/Qwen2.5-0.5B-Instruct") == from_first  # the same folder, however it is spelled
    # the folder the store writes to
    assert cache_keys.store_identity(relative.storage) == (ArtifactStore("outputs/store").url("x").removesuffix("/x"),)


def test_an_s3_store_is_keyed_by_its_endpoint(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    one, other = (load_config(None, ["storage.root=s3://bucket/prefix", f"storage.endpoint_url={url}"])
                  for url in ("http://127.0.0.1:9000", "http://10.0.0.2:9000"))
    assert keys(one, "Qwen/Qwen2.5-0.5B-Instruct")["data"] != keys(other, "Qwen/Qwen2.5-0.5B-Instruct")["data"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")  # what ArtifactStore uses when none is given
    no_endpoint = load_config(None, ["storage.root=s3://bucket/prefix"])
    assert keys(no_endpoint, "Qwen/Qwen2.5-0.5B-Instruct") == keys(one, "Qwen/Qwen2.5-0.5B-Instruct")


def test_a_cached_result_naming_an_artifact_the_store_lost_is_a_miss(tmp_path):
    """Prefect returns the result cached under the key without running the task (a hit), if there is one."""
    cfg = load_config(None, [f"storage.root={tmp_path / 'store'}"])
    run = SimpleNamespace(result_store=ResultStore(result_storage=LocalFileSystem(basepath=str(tmp_path / "results")),
                                                   serializer=JSONSerializer()))  # what a task run passes
    store, results = stages.open_store(cfg), run.result_store
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.parquet").write_text("first")
    dataset = store.put_dir("dataset", "synthetic", tmp_path / "data")
    key = stages.data_prep_task.cache_key_fn(run, {"cfg": cfg})
    assert key == stages.data_prep_task.cache_key_fn(None, {"cfg": cfg})  # nothing cached yet
    results.write(str(dataset), key=key)  # what the first run cached
    assert stages.data_prep_task.cache_key_fn(run, {"cfg": cfg}) == key  # the artifact is there: a hit

    store.delete(dataset)  # as the corrupt-artifact error tells the user to
    rerun = stages.data_prep_task.cache_key_fn(run, {"cfg": cfg})
    assert rerun != key and not results.exists(rerun)  # a miss: the task runs again

    (tmp_path / "data" / "train.parquet").write_text("second")
    remade = store.put_dir("dataset", "synthetic", tmp_path / "data")
    results.write(str(remade), key=rerun)  # what the re-run cached
    assert stages.data_prep_task.cache_key_fn(run, {"cfg": cfg}) == rerun  # and the run after it hits that


def test_results_cached_before_a_refresh_are_misses_even_when_the_refresh_failed(tmp_path):
    """A --refresh-cache run that failed mid-SFT, resumed with the printed command (no --refresh-cache): the old
    SFT result was a hit (Prefect overwrites a record only when the refreshed task finishes), and so the stages
    after it, all from before the refresh. Every result cached before the refresh started is a miss now; what the
    refresh (or a run after it) cached is a hit."""
    import time
    from types import SimpleNamespace

    from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings

    cfg = load_config(None, [f"storage.root={tmp_path / 'store'}"])
    results = ResultStore(result_storage=LocalFileSystem(basepath=str(tmp_path / "results")),
                          serializer=JSONSerializer())
    first, refresh = (SimpleNamespace(result_store=results, task_run=SimpleNamespace(flow_run_id=run))
                      for run in ("flow-1", "flow-2"))
    key_of = stages.data_prep_task.cache_key_fn
    old = key_of(first, {"cfg": cfg})
    results.write("an old result", key=old)
    assert key_of(first, {"cfg": cfg}) == old  # a hit
    time.sleep(0.01)
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}):
        during = key_of(refresh, {"cfg": cfg})  # the refresh writes its marker; it caches under this key if it ends
    assert during != old and not results.exists(during)
    resumed = key_of(first, {"cfg": cfg})  # the printed resume command, no refresh
    assert resumed == during and not results.exists(resumed)  # a miss: the stage runs (from its checkpoints)
    results.write("the refreshed result", key=resumed)
    assert key_of(first, {"cfg": cfg}) == resumed  # and the runs after it hit that
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}):
        assert key_of(refresh, {"cfg": cfg}) == resumed  # the same refresh run's other tasks: one marker


def test_every_artifact_ref_in_a_cached_evaluation_record_is_checked():
    record = {"label": "base", "model": "Qwen/Qwen2.5-0.5B-Instruct", "dataset": "dataset/gsm8k@0123456789abcdef",
              "eval": "eval/base@fedcba9876543210", "engine": "hf", "acc": 0.5}
    assert [str(ref) for ref in cache_keys._artifact_refs(record)] == ["dataset/gsm8k@0123456789abcdef",
                                                                    "eval/base@fedcba9876543210"]


def test_a_stage_whose_output_changed_does_not_reuse_results_cached_before(monkeypatch):
    """Merge results cached before merges were cast to the run's dtype were float32 models: with merge at output
    version 2 its key is not the old one, and bumping a stage moves that stage's key only."""
    cfg = load_config(None, [])
    params = {"cfg": cfg, "checkpoint": "checkpoint/rl-x@0123456789abcdef", "base_model": "model/sft@0123456789abcdef"}
    merge_key = stages.merge_task.cache_key_fn(None, params)
    inputs = [params["checkpoint"], params["base_model"]]
    old_key = f"merge-{cache_keys.stage_hash(cfg, cache_keys.merge_sections, inputs)}"
    assert merge_key.startswith("merge-v2-") and merge_key != old_key
    before = keys(cfg, "model/sft@0123456789abcdef")

    monkeypatch.setitem(cache_keys.OUTPUT_VERSIONS, "sft", 2)  # keys are built with the task: build them again
    params.update(dataset="dataset/file@0123456789abcdef")
    sft_key = cache_keys.stage_key("sft", cache_keys.sft_sections, ("dataset", "base_model"))(None, params)
    data_key = cache_keys.stage_key("data-prep", cache_keys.data_sections)(None, params)
    assert sft_key != before["sft"] and data_key == before["data"]


def test_settings_that_change_only_how_a_stage_runs_keep_its_key_and_its_checkpoints():
    """A RolloutFailed asks for a longer rl.async_training.rollout_timeout_s and says a rerun resumes: the new value
    made a new key, so RL started again from step 0 under a new name. What is trained still changes the key."""
    base = load_config(None, [])
    rl, sft = cache_keys.rl_sections, cache_keys.sft_sections
    for overrides in (["rl.async_training.rollout_timeout_s=1200"], ["rl.save_freq=5"], ["rl.max_ckpt_to_keep=4"],
                      ["rl.reward.num_workers=8"], ["rl.no_signal_steps=0"], ["rl.no_signal_frac=0.5"],
                      # what StaleEngineError and dynamic sampling's failure ask to raise
                      ["rl.rollout.logprob_check_tol=0.05", "rl.rollout.logprob_check_tokens=8"],
                      # what one does after running out of memory: the update does not depend on the split
                      ["rl.actor.micro_batch_size=2", "rl.critic.micro_batch_size=4"],
                      ["rl.actor.use_dynamic_bsz=true", "rl.actor.max_token_len_per_device=1024"]):
        assert cache_keys.stage_hash(load_config(None, overrides), rl, []) == cache_keys.stage_hash(base, rl, [])
    dapo = ["rl.algorithm.filter_groups=true"]
    assert cache_keys.stage_hash(load_config(None, [*dapo, "rl.algorithm.max_num_gen_batches=20"]), rl, []) == \
        cache_keys.stage_hash(load_config(None, dapo), rl, [])
    sft_key = cache_keys.stage_hash(base, sft, [])
    assert cache_keys.stage_hash(load_config(None, ["sft.save_freq=7"]), sft, []) == sft_key
    assert cache_keys.stage_hash(load_config(None, ["sft.micro_batch_size=8"]), sft, []) == sft_key
    for overrides in (["rl.total_steps=3"], ["rl.reward.timeout_s=3"], ["rl.async_training.max_staleness=2"],
                      ["rl.resume_mode=disable"]):
        assert cache_keys.stage_hash(load_config(None, overrides), rl, []) != cache_keys.stage_hash(base, rl, [])
    assert cache_keys.stage_hash(load_config(None, ["sft.epochs=1"]), sft, []) != sft_key
    # a config at the defaults hashes as it did before the operational settings were set aside
    assert config_hash(base.rl) == config_hash(cache_keys.at_defaults(base.rl, cache_keys.RL_OPERATIONAL))


def test_the_saved_config_with_the_decided_automatic_settings_keeps_the_keys(tmp_path):
    """The RL stage writes the settings its workers decided (None in the recipe) into the run's config.yaml, which
    the README says reruns the run: its keys were new, so that rerun trained SFT and RL again from step 0. The
    device settings of a section (offload after running out of memory) keep its key too."""
    from infra.config import to_yaml

    base = load_config(None, [])
    ctx = stages.RunContext(run_id="run-1", run_dir=str(tmp_path))
    (tmp_path / "config.yaml").write_text(to_yaml(base))
    decided = {"rl.actor.use_remove_padding": False, "rl.actor.use_torch_compile": False,
               "rl.actor.logprob_chunk_tokens": 1024, "rl.actor.reshard_after_forward": False,
               "rl.actor.grad_sync_every_micro_batch": False, "rl.actor.gradient_checkpointing": False,
               "rl.critic.reshard_after_forward": False, "rl.rollout.prefix_cache_rows": 0}
    stages.record_automatic_settings(ArtifactStore(str(tmp_path / "store")), ctx, decided)
    saved = load_config(str(tmp_path / "config.yaml"), [])
    assert saved.rl.actor.logprob_chunk_tokens == 1024 and saved.rl != base.rl
    for sections in (cache_keys.rl_sections, cache_keys.sft_sections):
        assert cache_keys.stage_hash(saved, sections, []) == cache_keys.stage_hash(base, sections, [])
    for overrides in (["rl.actor.offload=true", "rl.actor.optimizer_offload=true"], ["rl.critic.offload=true"],
                      ["rl.rollout.free_cache_engine=true", "rl.rollout.gpu_memory_utilization=0.8"]):
        assert cache_keys.stage_hash(load_config(None, overrides), cache_keys.rl_sections, []) == \
            cache_keys.stage_hash(base, cache_keys.rl_sections, [])
    sft = cache_keys.stage_hash(base, cache_keys.sft_sections, [])
    assert cache_keys.stage_hash(load_config(None, ["sft.offload=true"]), cache_keys.sft_sections, []) == sft


def test_the_number_of_eval_workers_is_part_of_the_eval_key(tmp_path):
    """Each eval worker samples its share of the prompts with the run's seed: other shares, other samples."""
    one, two = local_model_keys(tmp_path), local_model_keys(tmp_path, "ray.num_devices_per_node=2")
    assert one["eval"] != two["eval"]
    assert one["data"] == two["data"] and one["base"] == two["base"]
