"""The RL loop with a learned reward model, for real on CPU: a tiny random one-label Qwen2 classifier (on the
tiny policy's tokenizer) runs in its own Ray worker; 2 GRPO steps with vLLM. Every sample's `reward_rm` is
what RewardModelScorer gives for its (prompt messages, response), and its score is the rule score plus
`reward_model_weight` times that."""

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

from infra.checkpoints import StoreCheckpoints
from infra.config import load_config
from infra.sql import query
from infra.store import ArtifactStore
from infra.tracking import Tracker
from infra.trajectories import RunTables
from stages.rewards import default_compute_score
from stages.rewards.reward_model import RewardModelScorer
from tests.conftest import TINY_OVERRIDES

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

WEIGHT = 0.5
RL = ["rl.enabled=true", "rl.total_steps=2", "rl.train_batch_size=4", "rl.rollout.n=4",
      "rl.actor.ppo_mini_batch_size=4", "rl.actor.micro_batch_size=16", "rl.val_before_train=false",
      "rl.max_validation_samples=4", "rl.reward.num_workers=1", "data.max_response_length=40",
      f"rl.reward.reward_model_weight={WEIGHT}", "rl.reward.reward_model_batch_size=5"]


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # has the policy's chat template
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=(len(tokenizer) + 63) // 64 * 64, hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                         max_position_embeddings=512, num_labels=1)
    out = tmp_path_factory.mktemp("tiny-rm")
    Qwen2ForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def test_grpo_with_a_reward_model_scores_and_logs_it(tiny_data_dir, tiny_model_dir, rm_dir, tmp_path):
    from stages.rl import run_rl

    cfg = load_config(None, TINY_OVERRIDES + RL + [f"rl.reward.reward_model_path={rm_dir}"])
    store = ArtifactStore(str(tmp_path / "store"))
    checkpoints = StoreCheckpoints(store, "rm-test", cfg.rl.max_ckpt_to_keep)
    result = run_rl(cfg, str(tiny_model_dir), tiny_data_dir, checkpoints, RunTables(store, "rm-test"), Tracker([]))
    assert result.num_steps == 2
    root = str(tmp_path / "store")

    rows = query(root, "SELECT prompt, response, data_source, ground_truth, score, reward_rm FROM rollouts")
    assert len(rows) == 2 * 4 * 4
    assert all(r["reward_rm"] is not None for r in rows)
    by_prompt = {}  # the rollouts table keeps the last message's text; the train parquet has the chat lists
    for row in pq.read_table(tiny_data_dir / "train.parquet").to_pylist():
        by_prompt.setdefault(row["prompt"][-1]["content"], []).append(row)
    train_rows = []
    for r in rows:
        matches = by_prompt[r["prompt"]]
        assert all(m["prompt"] == matches[0]["prompt"] for m in matches)  # one chat per prompt text
        train_rows.append(matches[0])
    expected = RewardModelScorer(rm_dir).score([t["prompt"] for t in train_rows], [r["response"] for r in rows])
    # the same float32 model in the worker, on other batches (other padding): scores of ~0.03 move by ~1e-8
    assert [r["reward_rm"] for r in rows] == pytest.approx(expected, abs=1e-4)
    assert max(expected) - min(expected) > 1e-4  # the RM really tells responses apart
    for r, t, rm in zip(rows, train_rows, expected):  # score = rule + weight * rm
        rule = default_compute_score(t["data_source"], r["response"], t["reward_model"]["ground_truth"],
                                     t.get("extra_info") or {})
        assert r["score"] == pytest.approx(rule + WEIGHT * rm, abs=1e-4)

    rm_mean = [r["value"] for r in query(root, "SELECT value FROM metrics WHERE name = 'reward/rm/mean' "
                                               "ORDER BY step")]
    assert len(rm_mean) == 2
    steps = query(root, "SELECT step, avg(reward_rm) AS m FROM rollouts GROUP BY 1 ORDER BY 1")
    assert rm_mean == pytest.approx([s["m"] for s in steps], abs=1e-4)


def test_a_language_model_as_reward_model_is_refused(tiny_data_dir, tiny_model_dir, tmp_path):
    from stages.rl import run_rl

    cfg = load_config(None, TINY_OVERRIDES + RL + [f"rl.reward.reward_model_path={tiny_model_dir}"])
    store = ArtifactStore(str(tmp_path / "store"))
    with pytest.raises(Exception, match="no trained classification head"):
        run_rl(cfg, str(tiny_model_dir), tiny_data_dir, StoreCheckpoints(store, "rm-bad", 1),
               RunTables(store, "rm-bad"), Tracker([]))
