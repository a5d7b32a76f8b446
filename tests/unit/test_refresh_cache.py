"""--refresh-cache re-trains (tasks/stages.py): RL and SFT start again from step 0 instead of returning, or resuming
from, an earlier run's checkpoints (which may come from older code: what a refresh is for); a retry of the task in
the same flow run still resumes from what that run saved."""

from __future__ import annotations

import pytest
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings

from infra.config import load_config
from tasks import cache_keys, stages

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"  # a hub id: taken as it is, never loaded here


class Trained(Exception):
    """Raised by the fake run_rl: RL was started."""


def _checkpoint(store, tmp_path, name: str, step: int, flow_run: str):
    folder = tmp_path / f"ckpt-{flow_run}-{step}"
    folder.mkdir()
    (folder / "trainer.pt").write_text(f"{flow_run} {step}")
    return store.put_dir("checkpoint", name, folder, metadata={"step": step, "flow_run": flow_run})


@pytest.fixture
def rl(tmp_path, monkeypatch):
    """An RL stage whose final checkpoint an earlier flow run saved; run_rl records what it would resume from."""
    cfg = load_config(None, [f"storage.root={tmp_path / 'store'}", "tracking.backends=[jsonl]", "rl.total_steps=4"])
    store = stages.open_store(cfg)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.parquet").write_text("rows")
    dataset = str(store.put_dir("dataset", "synthetic", tmp_path / "data"))
    name = f"rl-{cache_keys.stage_hash(cfg, cache_keys.rl_sections, [dataset, MODEL])}"
    final = _checkpoint(store, tmp_path, name, 4, flow_run="earlier")
    ctx = stages.RunContext("now", str(tmp_path / "run"))
    ctx.tmp_dir.mkdir(parents=True)
    resumed_from = []

    def run_rl(cfg, model_dir, data_dir, checkpoints, tables, tracker):
        resumed_from.append(checkpoints.latest())
        raise Trained

    monkeypatch.setattr("stages.rl.run_rl", run_rl)
    return lambda: stages.rl_task.fn(cfg, dataset, MODEL, ctx), final, resumed_from, (store, name)


def test_rl_returns_an_existing_final_checkpoint(rl):
    run, final, resumed_from, _ = rl
    assert run() == str(final)
    assert resumed_from == []  # not trained


def test_rl_with_refresh_cache_trains_again_from_step_0(rl, caplog):
    run, final, resumed_from, _ = rl
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}), pytest.raises(Trained):
        run()
    assert resumed_from == [None]  # not the earlier run's final checkpoint
    assert f"instead of resuming from {final} (step 4, saved by flow run earlier)" in caplog.text


def test_a_refresh_removes_the_earlier_runs_checkpoints_before_it_trains(rl):
    """A refresh that failed before its first save left them: SFT's plain resume (the printed command) then took
    the old final checkpoint and wrote the old model again."""
    run, _, _, (store, name) = rl
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}), pytest.raises(Trained):
        run()
    assert store.versions("checkpoint", name) == []


def test_a_retry_under_refresh_cache_resumes_from_its_own_run(rl, tmp_path):
    run, _, resumed_from, (store, name) = rl
    _checkpoint(store, tmp_path, name, 2, flow_run="now")  # the refreshed run saved step 2, then failed
    store.delete(store.versions("checkpoint", name)[0].ref)  # ...after its first save replaced the earlier run's
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}), pytest.raises(Trained):
        run()
    assert resumed_from[0] is not None and (resumed_from[0] / "trainer.pt").read_text() == "now 2"


def test_a_refreshed_rl_run_removes_the_earlier_runs_checkpoints_before_its_tables(rl, tmp_path):
    """It removed the tables at the start and the checkpoints at its first save: a refresh that failed in between
    left the earlier run's final checkpoint, which the next run returned as the finished stage, without its rows."""
    from types import SimpleNamespace

    from infra.trajectories import RunTables
    from stages.rl import RLTrainer
    from tasks.stages import RefreshedCheckpoints

    _, _, _, (store, name) = rl
    tables = RunTables(store, name)
    for step in range(1, 5):
        tables.write_metrics(step, {"m": float(step)})
    order = []
    checkpoints = RefreshedCheckpoints(store, name, 3, metadata={"flow_run": "now"})
    trainer = RLTrainer.__new__(RLTrainer)  # resume() alone
    trainer.rl, trainer.tables = SimpleNamespace(resume_mode="auto"), SimpleNamespace(
        truncate_after=lambda step: order.append(("tables", store.versions("checkpoint", name))) or
        tables.truncate_after(step))
    trainer.checkpoints = checkpoints

    trainer.resume()

    assert order == [("tables", [])]  # the checkpoints went first
    assert store.versions("checkpoint", name) == [] and tables.steps("metrics") == []


@pytest.mark.parametrize("flag", [True, False])
def test_the_command_lines_refresh_cache_reaches_the_flow(monkeypatch, tmp_path, flag):
    """It set PREFECT_TASKS_REFRESH_CACHE in the environment after Prefect had read its settings: no effect."""
    from types import SimpleNamespace

    import flows.post_train as post_train_module

    calls = []
    monkeypatch.setattr(post_train_module, "post_train",
                        lambda *args, **kwargs: calls.append(kwargs) or SimpleNamespace(is_failed=lambda: False))
    monkeypatch.setattr(post_train_module.interrupt, "start_prefect_server", lambda: None)
    argv = [f"storage.root={tmp_path / 'store'}", f"run.output_dir={tmp_path / 'out'}", "tracking.console=verbose"]
    assert post_train_module.main(argv + ["--refresh-cache"] * flag) == 0
    assert calls[0]["refresh_cache"] is flag
