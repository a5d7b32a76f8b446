"""The asynchronous modes for real on CPU: a trainer worker and a rollout worker of its own (vLLM), weights pushed
over a gloo group, the producer thread and its queue, staleness in the `rollouts` table (SQL).

One Ray instance for the module, started with OMP_NUM_THREADS=1 so that the colocated and the separate placement
compute with the same thread count (the equality test compares them bit for bit).
"""

import logging
import os

import pytest
import torch

from infra.checkpoints import StoreCheckpoints
from infra.config import load_config
from infra.sql import query
from infra.store import ArtifactStore
from infra.tracking import Tracker
from infra.trajectories import RunTables
from stages.merge import checkpoint_metadata
from stages.model.fsdp import read_checkpoint_model_state
from tests.conftest import TINY_OVERRIDES

pytestmark = [pytest.mark.slow]

RL = ["rl.enabled=true", "rl.total_steps=3", "rl.train_batch_size=8", "rl.rollout.n=4",
      "rl.actor.ppo_mini_batch_size=4", "rl.actor.micro_batch_size=16", "rl.test_freq=0", "rl.save_freq=1",
      "rl.max_validation_samples=8", "rl.val_before_train=false", "rl.actor.optim.lr=1e-4",
      "rl.reward.num_workers=1", "data.max_response_length=40",
      "rl.reward.overlong_buffer=30"]  # rewards that differ within a group (a tiny untrained model scores 0)
SEPARATE = ["ray.rollout_devices_per_node=1"]
NO_CORRECTION = "no rollout correction: rl.algorithm.rollout_correction.rollout_is=token"
FULLY = [*SEPARATE, "rl.async_training.mode=fully_async", "rl.async_training.generation_groups=4",
         "rl.async_training.queue_groups=4", "rl.async_training.partial_rollout_tokens=4",
         "rl.async_training.max_staleness=1"]


@pytest.fixture(scope="module", autouse=True)
def ray_one_thread():
    import ray

    from infra.config_sections import RayConfig
    from stages.workers.group import init_ray

    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        init_ray(RayConfig(num_cpus=2))
        yield
        ray.shutdown()
    finally:
        os.environ.pop("OMP_NUM_THREADS") if old is None else os.environ.update(OMP_NUM_THREADS=old)


def run(data_dir, model_dir, root, *overrides):
    from stages.rl import run_rl

    cfg = load_config(None, TINY_OVERRIDES + RL + list(overrides))
    store = ArtifactStore(str(root))
    checkpoints = StoreCheckpoints(store, "rl-test", cfg.rl.max_ckpt_to_keep, {"init_model": str(model_dir)},
                                   checkpoint_metadata(cfg.model))
    result = run_rl(cfg, str(model_dir), data_dir, checkpoints, RunTables(store, "rl-test"), Tracker([]))
    return result, store


def metric(root, name: str) -> list[float]:
    return [r["value"] for r in query(str(root), f"SELECT value FROM metrics WHERE name = '{name}' ORDER BY step")]


def final_weights(store: ArtifactStore, result) -> dict[str, torch.Tensor]:
    return read_checkpoint_model_state(store.get_dir(result.checkpoint))


def test_sync_schedule_on_rollout_devices_equals_the_colocated_loop(tiny_data_dir, tiny_model_dir, tmp_path, caplog):
    """Staleness 0 on a rollout worker of its own: the same samples, losses and weights as the colocated loop."""
    colocated, store_a = run(tiny_data_dir, tiny_model_dir, tmp_path / "a")
    with caplog.at_level(logging.INFO, logger="stages.rl_async"):
        separate, store_b = run(tiny_data_dir, tiny_model_dir, tmp_path / "b", *SEPARATE)
    assert "staleness <= 0" in caplog.text and NO_CORRECTION not in caplog.text  # nothing stale to correct
    sql = "SELECT step, group_id, sample_index, response, score, staleness FROM rollouts ORDER BY 1, 2, 3"
    rows_a, rows_b = query(str(tmp_path / "a"), sql), query(str(tmp_path / "b"), sql)
    assert len(rows_a) == 3 * 8 * 4 and rows_a == rows_b
    for name in ("actor/pg_loss", "actor/grad_norm", "critic/rewards/mean", "train/frac_groups_zero_std"):
        assert metric(tmp_path / "a", name) == metric(tmp_path / "b", name), name
    assert max(metric(tmp_path / "a", "actor/grad_norm")) > 0
    assert metric(tmp_path / "b", "async/staleness/max") == [0.0, 0.0, 0.0]
    weights_a, weights_b = final_weights(store_a, colocated), final_weights(store_b, separate)
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def test_one_step_off_policy_trains_on_batches_one_version_old(tiny_data_dir, tiny_model_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="stages.rl_async"):
        run(tiny_data_dir, tiny_model_dir, tmp_path, *SEPARATE, "rl.async_training.mode=one_step_off")
    assert NO_CORRECTION in caplog.text  # the start line suggests the correction for stale samples
    assert "left the weight group" in caplog.text  # the finished run closed the push group before the kill
    rows = query(str(tmp_path), "SELECT step, min(staleness) AS lo, max(staleness) AS hi, "
                 "min(policy_version) AS v FROM rollouts GROUP BY 1 ORDER BY 1")
    # step 1's batch was made by version 0 and trains version 0; step s's by version s-2 while step s-1 trained
    assert rows == [{"step": 1, "lo": 0, "hi": 0, "v": 0}, {"step": 2, "lo": 1, "hi": 1, "v": 0},
                    {"step": 3, "lo": 1, "hi": 1, "v": 1}]
    assert max(metric(tmp_path, "rollout/logprob_diff_max")) < 1e-3  # every push checked
    rollout_memory = metric(tmp_path, "perf/rollout/cpu_memory_used_gb")  # the rollout worker's, at each push
    assert rollout_memory and min(rollout_memory) > 0.01


def test_fully_async_with_partial_rollouts_records_each_tokens_version(tiny_data_dir, tiny_model_dir, tmp_path):
    run(tiny_data_dir, tiny_model_dir, tmp_path, *FULLY, "rl.total_steps=4", "rl.rollout.logprob_check_freq=3")
    rows = query(str(tmp_path), "SELECT step, staleness, policy_version, policy_version_max, token_policy_versions, "
                 "num_response_tokens FROM rollouts ORDER BY step")
    assert len(rows) == 4 * 8 * 4
    assert all(0 <= r["staleness"] <= 1 for r in rows)
    for r in rows:
        versions = r["token_policy_versions"]
        assert len(versions) == r["num_response_tokens"] and versions == sorted(versions)
        assert (versions[0], versions[-1]) == (r["policy_version"], r["policy_version_max"])
    for r in rows:  # a push lands between segments of 4 tokens (whether one lands mid-sample depends on timing:
        versions = r["token_policy_versions"]  # tests/unit/test_rl_async.py interrupts a rollout for certain)
        assert all(versions[i] == versions[i - 1] for i in range(1, len(versions)) if i % 4)
    assert len(metric(tmp_path, "async/partial_frac")) == 4
    checked = query(str(tmp_path), "SELECT step FROM metrics WHERE name = 'rollout/logprob_diff_max' ORDER BY step")
    assert [r["step"] for r in checked] == [1, 3, 4]  # the first push, every 3rd, the last


def test_a_killed_rollout_worker_fails_the_run_clearly(tiny_data_dir, tiny_model_dir, tmp_path):
    """SIGKILL the rollout worker's process once step 1 is written: the run raises RolloutFailed, never hangs."""
    import signal
    import subprocess
    import threading
    import time

    import ray

    from stages.rl_async import RolloutFailed

    def kill_after_step_1():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if list((tmp_path / "metrics").glob("run_id=*/step=00000001")):
                pids = subprocess.run(["pgrep", "-f", "ray::RolloutWorker"], capture_output=True, text=True).stdout
                os.kill(int(pids.split()[0]), signal.SIGKILL)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_after_step_1, daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(RolloutFailed, match="rollout worker"):
        run(tiny_data_dir, tiny_model_dir, tmp_path, *FULLY, "rl.total_steps=30",
            "rl.async_training.rollout_timeout_s=120")
    assert time.monotonic() - start < 240
    killer.join()
    assert ray.is_initialized()
