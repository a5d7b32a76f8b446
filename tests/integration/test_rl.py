"""The RL stage for real on CPU: Ray workers, vLLM (CPU build) or transformers rollouts, FSDP2 training,
the reward process pool, trajectory tables in the store and SQL over them.

One Ray instance for the module; each run starts its own colocated worker (vLLM starts in ~5 s in-process).
"""

import math

import pytest

from infra.checkpoints import StoreCheckpoints
from infra.config import load_config
from infra.sql import query
from infra.store import ArtifactStore
from infra.tracking import Tracker
from infra.trajectories import RunTables
from stages.merge import checkpoint_metadata, merge_checkpoint, merge_source
from stages.model.loading import load_model
from tests.conftest import TINY_OVERRIDES

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

RL = ["rl.enabled=true", "rl.total_steps=3", "rl.train_batch_size=8", "rl.rollout.n=4",
      "rl.actor.ppo_mini_batch_size=4",
      "rl.actor.micro_batch_size=16", "rl.test_freq=2", "rl.save_freq=2", "rl.max_validation_samples=8",
      "rl.actor.optim.lr=1e-4", "rl.reward.num_workers=1", "data.max_response_length=40"]

RC = "rl.algorithm.rollout_correction."
VERL_METRICS = {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
                "critic/score/mean", "critic/advantages/mean", "response_length/mean", "response_length/clip_ratio",
                "timing_s/gen", "timing_s/update_actor", "timing_s/old_log_prob", "perf/throughput",
                "rollout/logprob_diff_max", "reward/errors", "reward/timeouts", "perf/cpu_memory_used_gb"}


def run(tiny_data_dir, tiny_model_dir, tmp_path, *overrides):
    from stages.rl import run_rl

    cfg = load_config(None, TINY_OVERRIDES + RL + list(overrides))
    store = ArtifactStore(str(tmp_path / "store"))
    checkpoints = StoreCheckpoints(store, "rl-test", cfg.rl.max_ckpt_to_keep, {"init_model": str(tiny_model_dir)},
                                   checkpoint_metadata(cfg.model))  # as the flow's rl task keeps them
    result = run_rl(cfg, str(tiny_model_dir), tiny_data_dir, checkpoints, RunTables(store, "rl-test"), Tracker([]))
    return result, str(tmp_path / "store")


def metric(root: str, name: str) -> list[float]:
    rows = query(root, f"SELECT value FROM metrics WHERE name = '{name}' ORDER BY step")
    return [r["value"] for r in rows]


def metric_steps(root: str, name: str) -> list[int]:
    return [r["step"] for r in query(root, f"SELECT step FROM metrics WHERE name = '{name}' ORDER BY step")]


def test_grpo_with_vllm_runs_logs_and_stores_everything(tiny_data_dir, tiny_model_dir, tmp_path):
    result, root = run(tiny_data_dir, tiny_model_dir, tmp_path)
    assert result.num_steps == 3
    names = {r["name"] for r in query(root, "SELECT DISTINCT name FROM metrics")}
    assert VERL_METRICS <= names, VERL_METRICS - names
    assert max(metric(root, "rollout/logprob_diff_max")) < 1e-3  # the engine follows the trainer (fp32)
    parts = [metric(root, f"timing_s/{name}") for name in ("sync_push", "sync_check", "sync")]
    assert [len(p) for p in parts] == [3, 3, 3]  # the sync's parts, every step, inside the step's sync
    assert all(0 < push and 0 < check and push + check <= whole for push, check, whole in zip(*parts))
    counts = query(root, "SELECT step, count(*) AS n FROM rollouts GROUP BY 1 ORDER BY 1")
    assert counts == [{"step": s, "n": 8 * 4} for s in (1, 2, 3)]
    row = query(root, "SELECT * FROM rollouts LIMIT 1")[0]
    for column in ("group_id", "prompt", "response", "score", "advantage", "old_logprob_mean", "entropy_mean",
                   "finish_reason", "policy_version", "num_response_tokens"):
        assert row[column] is not None, column
    assert query(root, "SELECT DISTINCT step FROM validation ORDER BY 1") == [{"step": s} for s in (0, 2, 3)]
    assert all(math.isfinite(v) for v in metric(root, "actor/pg_loss"))
    # RL's output is its final checkpoint; the merge stage makes the trained model of it, as a user does
    store = ArtifactStore(root)
    assert store.manifest(result.checkpoint).metadata["step"] == 3
    merged = merge_checkpoint(merge_source(store, result.checkpoint), tmp_path / "merged")
    load_model(merged.out_dir, load_config(None).model, trainable=False)  # a plain HF folder


@pytest.mark.parametrize("overrides", [
    ["rl.algorithm.adv_estimator=gae", "rl.critic.optim.lr=1e-3"],
    ["rl.algorithm.adv_estimator=rloo"],
    ["rl.algorithm.adv_estimator=reinforce_plus_plus", "rl.actor.use_kl_loss=true"],
    ["rl.algorithm.adv_estimator=remax"],
    ["rl.actor.policy_loss=gspo", "rl.actor.loss_agg_mode=seq-mean-token-mean", "rl.actor.clip_ratio_low=3e-4",
     "rl.actor.clip_ratio_high=4e-4"],
    ["rl.algorithm.adv_estimator=dr_grpo", "rl.actor.loss_agg_mode=seq-mean-token-sum-norm",
     "rl.algorithm.use_kl_in_reward=true", "rl.algorithm.kl_ctrl_type=adaptive"],
    ["model.lora.rank=8", "rl.actor.use_kl_loss=true", "rl.actor.optim.lr=1e-3"],
    ["rl.actor.use_remove_padding=true", "rl.actor.use_kl_loss=true"],
    [RC + "rollout_is=token", RC + "rollout_rs=token_k1", RC + "rollout_rs_threshold=0.5_2.0"],
    [RC + "bypass_mode=true", RC + "rollout_rs=seq_max_k3", RC + "rollout_rs_threshold=0.01"],
], ids=["ppo", "rloo", "reinforce_pp", "remax", "gspo", "dr_grpo_kl_reward", "lora_kl_loss", "packed", "tis_icepop",
        "bypass_rs"])
def test_algorithms_run(tiny_data_dir, tiny_model_dir, tmp_path, overrides):
    result, root = run(tiny_data_dir, tiny_model_dir, tmp_path, "rl.total_steps=2", "rl.val_before_train=false",
                       *overrides)
    assert result.num_steps == 2
    assert all(math.isfinite(v) for v in metric(root, "actor/pg_loss"))
    assert max(metric(root, "rollout/logprob_diff_max")) < 1e-3  # synced weights (LoRA: merged) match
    if "rl.algorithm.adv_estimator=gae" in overrides:
        assert all(math.isfinite(v) for v in metric(root, "critic/vf_loss"))
    if any(o.startswith(RC) for o in overrides):  # the engine (fp32) and the trainer agree: weights ~1, none rejected
        assert len(metric(root, "rollout_corr/kl")) == 2 and max(map(abs, metric(root, "rollout_corr/kl"))) < 1e-3
        assert metric(root, "rollout_corr/rollout_rs_masked_fraction") == [0.0, 0.0]
        bypass = RC + "bypass_mode=true" in overrides
        assert bool(metric(root, "timing_s/old_log_prob")) != bypass  # bypass: no old-logprob pass
        if not bypass:
            assert all(abs(v - 1) < 1e-3 for v in metric(root, "rollout_corr/rollout_is_mean"))


def test_hf_engine_runs_grpo(tiny_data_dir, tiny_model_dir, tmp_path):
    result, root = run(tiny_data_dir, tiny_model_dir, tmp_path, "rl.rollout.engine=hf", "rl.total_steps=2")
    assert result.num_steps == 2
    assert max(metric(root, "rollout/logprob_diff_max")) < 1e-3


def test_cuda_engine_runs_grpo(tiny_data_dir, tiny_model_dir, tmp_path):
    """rl.rollout.engine=cuda reaches our engine (eager on CPU, fp32): 3 GRPO steps, the weight sync checked after
    the first and the last (rl.rollout.logprob_check_freq=3 skips step 2's check)."""
    result, root = run(tiny_data_dir, tiny_model_dir, tmp_path, "rl.rollout.engine=cuda",
                       "rl.rollout.logprob_check_freq=3", "rl.test_freq=0")
    assert result.num_steps == 3
    assert metric_steps(root, "rollout/logprob_diff_max") == metric_steps(root, "timing_s/sync_check") == [1, 3]
    assert metric_steps(root, "timing_s/sync_push") == [1, 2, 3]
    assert max(metric(root, "rollout/logprob_diff_max")) < 1e-3
    assert max(metric(root, "response_length/mean")) > 0


BAD_REWARD = '''
import math, time, zlib
from stages.rewards import default_compute_score

def compute_score(data_source, solution_str, ground_truth, extra_info):
    kind = zlib.crc32(solution_str.encode()) % 5
    if kind == 0:
        raise RuntimeError("scorer bug")
    if kind == 1:
        time.sleep(1e9)
    if kind == 2:
        return math.nan
    return {"score": default_compute_score(data_source, solution_str, ground_truth, extra_info), "kind": kind}
'''


def test_bad_reward_functions_do_not_stop_the_run(tiny_data_dir, tiny_model_dir, tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(BAD_REWARD)
    result, root = run(tiny_data_dir, tiny_model_dir, tmp_path, f"rl.reward.custom_path={path}",
                       "rl.reward.on_failure=warn", "rl.reward.timeout_s=0.5", "rl.reward.num_workers=2",
                       "rl.total_steps=2", "rl.val_before_train=false", "rl.test_freq=0")
    assert result.num_steps == 2
    for name in ("reward/errors", "reward/timeouts", "reward/nan"):
        assert sum(metric(root, name)) > 0, name
    assert metric(root, "reward/kind/mean")  # extra dict keys are logged as reward components
    assert query(root, "SELECT count(*) AS n FROM rollouts WHERE reward_kind IS NOT NULL")[0]["n"] > 0


def test_dapo_dynamic_sampling_and_overlong_penalty(tiny_data_dir, tiny_model_dir, tmp_path):
    result, root = run(tiny_data_dir, tiny_model_dir, tmp_path, "rl.algorithm.filter_groups=true",
                       "rl.algorithm.filter_groups_metric=seq_reward", "rl.algorithm.max_num_gen_batches=20",
                       "rl.reward.overlong_buffer=16", "rl.actor.clip_ratio_high=0.28", "rl.total_steps=2",
                       "rl.val_before_train=false")
    assert result.num_steps == 2
    assert min(metric(root, "train/num_gen_batches")) >= 1
    # every kept group has varied rewards (the filter's whole point)
    spreads = query(root, "SELECT group_id, max(reward) - min(reward) AS spread FROM rollouts GROUP BY 1")
    assert spreads and all(r["spread"] > 0 for r in spreads)
