"""The post-training flow end to end through Prefect (a temporary local Prefect server), on a tiny config:
a first run executes every stage (data prep -> base -> SFT -> RL -> merge -> evaluate base/SFT/RL) and
publishes the comparison (evals table, Prefect table + markdown artifacts), a second run of its saved config.yaml
is all cache hits, and bad inputs fail cleanly. Evaluation uses the hf engine here (vLLM's is covered by
test_evaluate.py and, through the flow, by test_resume.py). The quiet console: a line per stage, Ray workers'
output in the run folder, a failing stage's error in full."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from infra.artifacts import ArtifactRef
from infra.config import ConfigError, load_config
from infra.sql import query
from infra.store import ArtifactStore
from tests.conftest import TINY_OVERRIDES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def post_train():
    from flows.post_train import post_train

    return post_train


RL = ["rl.enabled=true", "rl.total_steps=2", "rl.train_batch_size=8", "rl.rollout.n=4", "rl.rollout.engine=hf",
      "rl.actor.ppo_mini_batch_size=4", "rl.test_freq=0", "rl.val_before_train=false", "rl.reward.num_workers=1",
      "ray.num_cpus=2", "data.max_response_length=24", "evaluate.engine=hf"]
STAGES = ["data-prep", "base-model", "sft", "rl", "merge", "evaluate-base", "evaluate-sft", "evaluate-rl"]
PROJECT = Path(__file__).resolve().parents[2]


def _overrides(tmp_path, *extra):
    return TINY_OVERRIDES + [f"storage.root={tmp_path / 'store'}", f"run.output_dir={tmp_path / 'out'}",
                             "tracking.backends=[jsonl]", *extra]


def test_flow_runs_then_hits_the_cache(post_train, tmp_path, capfd):
    first = post_train(None, _overrides(tmp_path, *RL))
    assert first["stages"] == {k: "Completed" for k in STAGES}
    acc = first["results"]["sft"]["acc"]
    assert 0.0 <= acc <= 1.0
    assert {r["engine"] for r in first["results"].values()} == {"hf"}
    _check_quiet_console("".join(capfd.readouterr()), Path(first["run_dir"]))

    # The run's saved config.yaml (with the settings the workers decided) reruns it: all cache hits. The console
    # switch is a flow parameter like any other (tracking is in no cache key).
    second = post_train(str(Path(first["run_dir"]) / "config.yaml"), ["tracking.console=verbose"])
    assert second["stages"] == {k: "Cached" for k in STAGES}
    assert second["results"] == first["results"]
    console = capfd.readouterr().out
    assert all(re.search(rf"^\S+ {name} +cached ", console, re.M) for name in STAGES), console
    assert "Ray workers' output" not in console and f"logs: {second['run_dir']}/run.log" in console

    # An unrelated section's change re-runs only what reads it.
    third = post_train(None, _overrides(tmp_path, *RL, "evaluate.max_samples=8"))
    assert {k for k, v in third["stages"].items() if v == "Completed"} == {"evaluate-base", "evaluate-sft",
                                                                           "evaluate-rl"}

    store = ArtifactStore(str(tmp_path / "store"))
    [sft] = store.versions("model", "sft")
    assert sft.inputs["dataset"].startswith("dataset/synthetic@") and sft.config_hash
    # RL hands its final checkpoint to merge; the merged model, not a copy made by RL, is what was evaluated.
    [rl] = store.versions("model", "rl")
    checkpoint = store.manifest(ArtifactRef.parse(rl.inputs["checkpoint"]))
    assert checkpoint.kind == "checkpoint" and checkpoint.metadata["step"] == 2
    assert checkpoint.metadata["model_config"]["lora"] is None
    assert rl.inputs["base_model"] == str(sft.ref) == checkpoint.inputs["init_model"]
    assert first["results"]["rl"]["model"] == str(rl.ref)
    _check_published(tmp_path, first, third)
    run_dir = tmp_path / "out" / "runs" / first["run_id"]
    assert (run_dir / "config.yaml").read_text().count("storage:") == 1
    # the automatic settings as the workers decided them (CPU), written into the run's config, which reruns as is
    ran = load_config(str(run_dir / "config.yaml"))
    assert (ran.rl.actor.use_remove_padding, ran.rl.actor.use_torch_compile, ran.rl.actor.logprob_chunk_tokens,
            ran.rl.actor.reshard_after_forward, ran.rl.rollout.prefix_cache_rows) == (False, False, 1024, False, 0)
    assert store.read_bytes(f"runs/{first['run_id']}/config.yaml") == (run_dir / "config.yaml").read_bytes()
    metrics = [json.loads(line) for line in (run_dir / f"{first['run_id']}-sft.metrics.jsonl").open()]
    assert {"train/loss", "train/lr", "train/grad_norm"} <= set(metrics[0])
    assert "val/loss" in metrics[-1]
    assert store.glob(f"runs/{first['run_id']}/config.yaml")

    # --refresh-cache (the flow's refresh_cache): every stage runs again. The command line set Prefect's variable
    # after Prefect had read its settings, so every stage came back cached.
    refreshed = post_train(None, _overrides(tmp_path, *RL), refresh_cache=True)
    assert refreshed["stages"] == {k: "Completed" for k in STAGES}


def _check_quiet_console(console: str, run_dir: Path) -> None:
    """A line as each stage starts and ends, the table; Ray workers' output and INFO logs in the run folder."""
    for name in STAGES:
        assert re.search(rf"^\d\d:\d\d:\d\d {name} +started$", console, re.M), console
        assert re.search(rf"^\d\d:\d\d:\d\d {name} +ran +[\dm.]+s  \S", console, re.M), console
    assert re.search(r" data-prep +ran .*  256 train / 32 validation rows$", console, re.M), console
    assert re.search(r" sft +ran .*  final loss train \d\.\d{3}, val \d\.\d{3}$", console, re.M), console
    rl_line = r" rl +ran .*  2 steps, validation acc [\d.]+% -> [\d.]+%, last mean score \d\.\d{3}$"
    assert re.search(rl_line, console, re.M), console
    assert re.search(r" evaluate-rl +ran .*  held-out acc [\d.]+%$", console, re.M) and "run report: " in console
    assert "pid=" not in console and "Worker" not in console  # Ray prefixes worker lines "(EvalWorker pid=...)"
    log = (run_dir / "run.log").read_text()
    assert "Task run 'sft" in log and "Finished in state Completed()" in log
    assert "started a local Ray cluster" in log and "placement group: 1 bundles" in log
    assert ":actor_name:ActorRolloutWorker" in (run_dir / "workers" / "rl.log").read_text()
    for label in ("base", "sft", "rl"):
        assert ":actor_name:EvalWorker" in (run_dir / "workers" / f"evaluate-{label}.log").read_text()


def _check_published(tmp_path, run: dict, last: dict) -> None:
    """The run's comparison is in the evals view and in Prefect's table and markdown artifacts; each flow run has
    its own report, and Prefect's latest run-report artifact links the last run's."""
    from prefect.artifacts import Artifact

    rows = query(str(tmp_path / "store"), "SELECT label, metric, value, model, engine FROM evals WHERE run_id = "
                                          f"'{run['run_id']}' AND data_source = 'all' ORDER BY label")
    assert rows == [{"label": label, "metric": "acc", "value": run["results"][label]["acc"],
                     "model": run["results"][label]["model"], "engine": "hf"} for label in ("base", "rl", "sft")]
    assert len(query(str(tmp_path / "store"), "SELECT DISTINCT run_id FROM evals")) == 3  # one per flow run
    table = json.loads(Artifact.get("post-train-evals").data)
    overall = next(r for r in table if r["data_source"] == "all" and r["metric"] == "acc")
    assert set(overall) == {"data_source", "metric", "base", "sft", "rl"}
    markdown = Artifact.get("post-train-evals-report").data
    assert "| data_source | metric | base | sft | rl |" in markdown and run["results"]["rl"]["model"] in markdown
    report = Path(run["report"])  # the RL run's HTML report, in the store, linked from a markdown artifact
    assert report.is_relative_to(tmp_path / "store") and "<img" in report.read_text()
    assert report.parent.name == run["run_id"] and Path(last["report"]).parent.name == last["run_id"]
    assert Path(last["report"]).as_uri() in Artifact.get("run-report").data


def test_bad_config_fails_before_any_stage(post_train, tmp_path):
    with pytest.raises(ConfigError, match="sft.optim.lr"):
        post_train(None, _overrides(tmp_path, "sft.optim.lr=-1"))
    assert not (tmp_path / "store").exists()


def test_dataset_missing_ground_truth_fails_and_leaves_no_artifact(post_train, tmp_path, capfd):
    """Called from Python, as a deployment's run calls it: the error is on the console once, Prefect's engine frames
    cut to one line (the flow run's own report of it showed it a second time)."""
    rows = [{"question": "What is 1 + 1?", "answer": "#### 2"}, {"question": "What is 2 + 2?"}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capfd.readouterr()
    with pytest.raises(ValueError, match=r"row 1 .*'answer'"):
        post_train(None, _overrides(tmp_path, "data.source=file", f"data.path={path}"))
    console = "".join(capfd.readouterr())
    assert console.count("Traceback (most recent call last)") == 1 and "Encountered exception" not in console
    assert re.search(r"\[\d+ frames of Prefect's engine: run.log has the whole traceback\]", console), console
    store = ArtifactStore(str(tmp_path / "store"))
    assert store.artifacts() == []
    assert not list((tmp_path / "store").glob(".staging/*"))


def test_unreachable_s3_endpoint_is_one_clear_error(post_train, tmp_path, s3_server):
    """The flow checks its store before anything runs (as the command line does), naming both settings."""
    overrides = _overrides(tmp_path) + ["storage.root=s3://bucket/prefix", "storage.endpoint_url=http://127.0.0.1:9"]
    with pytest.raises(ConfigError, match=r"storage.root=s3://bucket/prefix: .*storage.endpoint_url='http://127"):
        post_train(None, overrides)
    assert not (tmp_path / "out").exists()


def test_a_failing_stage_shows_its_error_in_full_on_the_console(tmp_path):
    """The command line, as a user runs it: RL fails at start (more prompts per step than the dataset has)."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(tmp_path / "prefect" / "results")}
    overrides = _overrides(tmp_path, *RL, "rl.train_batch_size=512")
    done = subprocess.run([sys.executable, "-m", "flows.post_train", *overrides], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=900)
    console = done.stdout + done.stderr
    assert done.returncode == 1, console
    message = "ValueError: rl.train_batch_size=512 > 256 training prompts"
    assert console.count("Traceback (most recent call last)") == 1  # the stage's, not repeated by the flow's
    assert re.search(r'File ".*stages/rl_data.py", line \d+, in __init__\n +raise ValueError', console), console
    assert console.count(message) == 1 and re.search(r"^\S+ rl +failed after .*: ValueError", console, re.M), console
    assert re.search(r"^\S+ sft +ran ", console, re.M)
    infos = [line for line in console.splitlines() if "| INFO" in line]
    assert infos == [], infos  # a bad value fails the same way again: not retried (tasks.stages.transient)
    [run_log] = (tmp_path / "out" / "runs").glob("*/run.log")
    assert f"logs: {run_log}" in console and message in run_log.read_text()


def test_a_failing_stage_shows_its_error_once_then_the_logs_and_the_command_that_resumes(tmp_path):
    """A bad row in the data file: the console showed the error four times (Prefect's task-run line, the stage's line,
    the flow run's report and its traceback). Now once, in full, then one line with the logs and how to resume."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"question": "What is 1 + 1?", "answer": "#### 2"}\n{"question": "What is 2 + 2?"}\n')
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(tmp_path / "prefect" / "results")}
    overrides = _overrides(tmp_path, "data.source=file", f"data.path={path}")
    done = subprocess.run([sys.executable, "-m", "flows.post_train", *overrides, "--refresh-cache"], cwd=PROJECT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    console = done.stdout
    assert done.returncode == 1, console
    message = "row 1 (line 2) of data.jsonl: field 'answer' (mapped by data.columns.answer) is missing"
    assert console.count(message) == 1, console
    lines = console.splitlines()
    failed = next(i for i, line in enumerate(lines) if re.match(r"\S+ data-prep +failed after .*: ValueError", line))
    assert lines[failed + 1] == "Traceback (most recent call last):", console
    assert re.search(r'File ".*data/files.py", line \d+, in convert_rows\n +raise ValueError', console), console
    [run_log] = (tmp_path / "out" / "runs").glob("*/run.log")
    assert lines[-2].startswith("ValueError: " + message) and lines[-1] == (
        f"logs: {run_log}, Ray workers' output in {run_log.parent / 'workers'}/; once the cause is fixed, resume "
        f"(finished stages are cached): {sys.executable} -m flows.post_train {shlex.join(overrides)}"), console
    assert "| ERROR" not in console and "Finished in state" not in console  # Prefect's reports: run.log only
    assert "Finished in state Failed" in run_log.read_text() and message in run_log.read_text()


def test_constant_rewards_warn_in_console_log_report_and_prefect(tmp_path):
    """A reward that is 0 for every sample gives GRPO nothing to learn from: the run says so on the console, in
    run.log, in the HTML report and in Prefect's run-report artifact (the command line, as a user runs it)."""
    reward = tmp_path / "zero.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    overrides = _overrides(tmp_path, *RL, "rl.total_steps=3", "rl.no_signal_steps=2", "sft.enabled=false",
                           f"rl.reward.custom_path={reward}", "evaluate.max_samples=4")
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(tmp_path / "prefect" / "results")}
    done = subprocess.run([sys.executable, "-m", "flows.post_train", *overrides], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=900)
    console = done.stdout + done.stderr
    said = "RL has almost no learning signal: at steps 1-2, 100% of the groups"
    assert done.returncode == 0 and console.count(said) == 1, console
    [run_dir] = (tmp_path / "out" / "runs").iterdir()
    assert said in (run_dir / "run.log").read_text()
    page = tmp_path / "store" / "runs" / run_dir.name / "report.html"
    assert '<div class="warning" role="alert">' in page.read_text() and said in page.read_text()
    artifact = subprocess.run([sys.executable, "-c", "from prefect.artifacts import Artifact; "
                               "print(Artifact.get('run-report').data)"], env=env, capture_output=True, text=True,
                              timeout=300)
    assert f"> **Warning:** {said}" in artifact.stdout, artifact.stdout + artifact.stderr
    frac = query(str(tmp_path / "store"), "SELECT step, value FROM metrics WHERE name = 'train/frac_groups_all_wrong' "
                                          "ORDER BY step")
    assert frac == [{"step": s, "value": 1.0} for s in (1, 2, 3)]
