"""Scale-out on CPU: N colocated Ray workers (placement group, one gloo FSDP2 world per role, one rollout
engine per worker) compute what one worker computes, learn, and checkpoint sharded.

1. The same global batch through 1 and 2 workers, and 1 and 4 (each with the driver's dispatch: balance, split, gather):
   equal old/ref logprobs and values, losses, gradients and gradient norms (up to float32 summation order),
   and equal parameters after the update wherever Adam's normalised step does not amplify that rounding.
2. GRPO on 2 workers with vLLM engines raises the mean reward.
3. A 2-worker PPO run checkpoints sharded (torch.distributed.checkpoint), resumes on 2 workers exactly, and
   the merge stage's reader consolidates the shards into the weights the live workers trained.

One Ray instance for the module, with 4 logical CPU slots (a 4-worker group of two roles takes them all).
The dispatch helpers (split, gather, balance) are also tested on their own, without Ray.
"""

import logging
import math
import random

import pytest
import torch

from infra.checkpoints import StoreCheckpoints
from infra.config import load_config
from infra.config_sections import RayConfig
from infra.sql import query
from infra.store import ArtifactStore
from infra.tracking import Tracker
from infra.trajectories import RunTables
from stages.agent import Trajectory
from stages.batch import Batch, balance_batch, build_batch, gather_rows, rank_rows, token_level_scores
from stages.core import AdvantageInputs, compute_advantages
from stages.data_prep import load_prompts
from stages.merge import checkpoint_metadata, merge_checkpoint, merge_source
from stages.model.fsdp import hf_weights, read_checkpoint_model_state
from stages.model.loading import load_model, load_tokenizer
from stages.rl_data import rollout_batch
from stages.workers.train_engine import balanced_groups
from tests.conftest import TINY_OVERRIDES
from tests.tolerances import REORDER_RTOL, assert_close_reordered

RL = ["rl.enabled=true", "rl.train_batch_size=8", "rl.rollout.n=4", "rl.actor.ppo_mini_batch_size=4",
      "rl.reward.num_workers=1", "data.max_response_length=24", "rl.max_validation_samples=8"]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from stages.workers.group import init_ray

    init_ray(RayConfig(num_cpus=4, num_devices_per_node=2))
    yield
    ray.shutdown()


# ---- 0. dispatch (pure) -----------------------------------------------------------------------------


def test_each_rank_gets_its_share_of_every_mini_batch_and_gather_inverts_it():
    shards = rank_rows(16, 2, 8)
    assert shards == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert rank_rows(7, 2, 4) == [[0, 1, 4, 5], [2, 3, 6]]  # a short last chunk: parts differ by one row
    values = torch.arange(16.0) * 10
    assert torch.equal(gather_rows([values[s] for s in shards], shards), values)


def test_balance_batch_evens_tokens_per_rank_inside_each_mini_batch():
    rng = random.Random(1)
    lengths = [rng.choice([1, 2, 3, 40]) for _ in range(32)]
    groups = [f"g{i // 4}" for i in range(32)]
    batch = build_batch([[5]] * 32, [[7] * n for n in lengths], [[0.0] * n for n in lengths], 0,
                        {"group_id": groups, "row": list(range(32))})
    batch.tensors["scores"] = torch.arange(32.0)
    balanced, metrics = balance_batch(batch, 2, 16)
    rows = balanced.meta["row"]
    assert sorted(rows[:16]) == list(range(16)) and sorted(rows[16:]) == list(range(16, 32))  # same mini-batches
    assert balanced.tensors["scores"].tolist() == [float(r) for r in rows]  # tensors move with their rows
    assert balanced.meta["group_id"] == [groups[r] for r in rows]
    per_rank = [sum(lengths[rows[i]] + 1 for i in shard) for shard in rank_rows(32, 2, 16)]
    assert metrics["global_seqlen/balanced_max"] == max(per_rank) < metrics["global_seqlen/max"]
    assert max(per_rank) - min(per_rank) <= 40  # within one long row


def test_balance_batch_keeps_an_order_it_cannot_improve():
    lengths = [1, 8, 7, 9, 5, 6, 7, 5]  # greedy with 4 rows per rank: 30 tokens on one rank; as given: 29
    batch = build_batch([[5]] * 8, [[7] * n for n in lengths], [[0.0] * n for n in lengths], 0)
    balanced, metrics = balance_batch(batch, 2, 8)
    assert balanced is batch
    assert metrics["global_seqlen/balanced_max"] == metrics["global_seqlen/max"] == 29


def test_micro_batch_groups_match_another_ranks_count():
    groups = balanced_groups([5, 1, 9, 3, 3], 3)
    assert sorted(r for g in groups for r in g) == [0, 1, 2, 3, 4] and all(groups)
    assert sorted(sum([5, 1, 9, 3, 3][r] for r in g) for g in groups) == [6, 6, 9]


# ---- 1. one worker == two workers ------------------------------------------------------------------


def a_batch(cfg, model_dir, data_dir) -> tuple[Batch, list[list[int]]]:
    """32 samples of 8 prompts with responses of varied lengths (random tokens, some ending in EOS), random
    0/1 scores; meta `row` identifies each sample whatever order the dispatch puts it in."""
    tokenizer = load_tokenizer(model_dir)
    prompts = load_prompts(data_dir / "train.parquet", tokenizer, cfg.data)
    rng = random.Random(0)
    indices = list(range(8))
    outputs = []
    for p in range(len(indices)):
        for _ in range(cfg.rl.rollout.n):
            length = rng.randint(1, cfg.data.max_response_length)
            ids = [rng.randrange(10, tokenizer.vocab_size) for _ in range(length)]
            finish = "length" if length == cfg.data.max_response_length else "stop"
            if finish == "stop":
                ids[-1] = tokenizer.eos_token_id
            outputs.append(Trajectory(p, ids, [1] * length, [-rng.random() for _ in ids], finish,
                                      tokenizer.decode(ids)))
    batch = rollout_batch(prompts, indices, outputs, "t", tokenizer.pad_token_id)
    batch.meta["row"] = list(range(len(batch)))
    scores = torch.tensor([float(rng.random() < 0.4) for _ in range(len(batch))])
    batch.tensors["scores"] = batch.tensors["rewards"] = scores
    return batch, prompts.prompt_ids[:2]


def keep_gradients(worker, model_attr: str) -> None:
    """In a worker (Ray's `__ray_call__`): before each optimizer step, keep the full gradients it steps with
    (gathered from the shards: a collective, which every rank runs at the same step)."""
    names = {param: name for name, param in getattr(worker, model_attr).named_parameters()}
    worker.kept_gradients = []
    worker.trainer.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: worker.kept_gradients.append(
        {names[p]: p.grad.full_tensor() for group in optimizer.param_groups for p in group["params"]}))


def kept_gradients(worker) -> list[dict[str, torch.Tensor]]:
    return worker.kept_gradients


def run_workers(cfg, model_dir, batch: Batch, check_prompts, num_workers: int, inputs: dict | None = None) -> dict:
    """What the RL driver does with one step's batch, on `num_workers` workers; per-row results in `row` order,
    and the gradients of each optimizer step. `inputs` (per-row old/ref logprobs and values, in `row` order)
    replace the computed ones for the update."""
    from stages.workers.actor_rollout import ActorRolloutWorker
    from stages.workers.critic import CriticWorker
    from stages.workers.group import Placement, WorkerGroup

    cfg = cfg.model_copy(update={"ray": RayConfig(num_devices_per_node=num_workers)})
    mini_rows = cfg.rl.actor.ppo_mini_batch_size * cfg.rl.rollout.n
    placement = Placement(cfg.ray, num_roles=2)
    actor = WorkerGroup(ActorRolloutWorker, cfg, model_dir, placement)
    critic = WorkerGroup(CriticWorker, cfg, model_dir, placement)
    try:
        batch, _ = balance_batch(batch, num_workers, mini_rows)
        t = batch.tensors
        t["old_logprobs"], t["entropy"] = actor.map_rows("compute_logprobs", batch, mini_rows, "actor", True)
        t["ref_logprobs"], _ = actor.map_rows("compute_logprobs", batch, mini_rows, "ref")
        t["values"] = critic.map_rows("compute_values", batch, mini_rows)
        out = {"old_logprobs": t["old_logprobs"], "entropy": t["entropy"], "ref_logprobs": t["ref_logprobs"],
               "values": t["values"]}
        if inputs is not None:
            for key in ("old_logprobs", "ref_logprobs", "values"):
                t[key] = inputs[key][torch.tensor(batch.meta["row"])]
        mask = batch.response_mask
        t["token_level_rewards"] = token_level_scores(t["rewards"], mask)
        t["advantages"], t["returns"] = compute_advantages(
            "gae", AdvantageInputs(token_level_rewards=t["token_level_rewards"], response_mask=mask,
                                   index=batch.meta["group_id"], values=t["values"]), gamma=1.0, lam=1.0)
        before = actor.call_one("hf_state")
        actor.call("__ray_call__", keep_gradients, "actor")
        critic.call("__ray_call__", keep_gradients, "model")
        out["critic_metrics"] = critic.split_call("update", batch, mini_rows)
        out["actor_metrics"] = actor.split_call("update_actor", batch, mini_rows)
        out["weights"], out["before"] = actor.call_one("hf_state"), before
        out["actor_grads"], out["critic_grads"] = (g.call_one("__ray_call__", kept_gradients) for g in (actor, critic))
        out["sync"] = actor.call_one("sync_weights", check_prompts)
    finally:
        actor.kill()
        critic.kill()
        placement.remove()
    order = torch.argsort(torch.tensor(batch.meta["row"]))  # back to the original row order
    for key in ("old_logprobs", "entropy", "ref_logprobs", "values"):
        out[key] = out[key][order]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [2, 4])
def test_n_workers_compute_what_one_worker_computes(ray_cluster, tiny_model_dir, tiny_data_dir, num_workers):
    # 2 mini-batches of 16 samples; micro-batches of 3 rows split them differently at N=1 and N=2 or 4
    cfg = load_config(None, TINY_OVERRIDES + RL + [
        "rl.rollout.engine=hf", "rl.algorithm.adv_estimator=gae", "rl.actor.micro_batch_size=3",
        "rl.critic.micro_batch_size=5", "rl.actor.use_kl_loss=true", "rl.actor.kl_loss_coef=0.1",
        "rl.actor.entropy_coeff=0.01", "rl.actor.optim.lr=1e-4", "rl.critic.optim.lr=1e-3",
        "rl.actor.optim.grad_clip=100",
        "rl.critic.optim.grad_clip=100"])
    batch, check_prompts = a_batch(cfg, tiny_model_dir, tiny_data_dir)
    one = run_workers(cfg, str(tiny_model_dir), batch, check_prompts, 1)
    # the update's inputs come from the 1-worker pass, so the comparison isolates the update itself. FSDP2
    # settings: at N=1 both roles keep gathered weights and reduce gradients once per mini-batch (the
    # one-device defaults); at N=2 the critic uses the multi-device defaults (reshard, reduce every
    # micro-batch) and the actor the one-device ones, so every combination meets the 1-worker result
    actor_once = {"reshard_after_forward": False, "grad_sync_every_micro_batch": False}
    cfg_two = cfg.model_copy(update={"rl": cfg.rl.model_copy(
        update={"actor": cfg.rl.actor.model_copy(update=actor_once)})})
    two = run_workers(cfg_two, str(tiny_model_dir), batch, check_prompts, num_workers, inputs=one)

    # Per token, forwards over other micro-batches (other padding and summation order): this model's float32
    # logprobs are within 1e-6 of their float64 values, so the two runs differ by about 2e-6.
    for key in ("old_logprobs", "entropy", "ref_logprobs", "values"):
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=1e-5, msg=key)
    metrics = one["actor_metrics"] | one["critic_metrics"], two["actor_metrics"] | two["critic_metrics"]
    # Token means of terms computed from such logprobs: they differ by <= ~2e-6 x the terms' size (<= 1 but for
    # the entropy's 6, which rel covers). abs: pg_loss, whose terms (whitened advantages) cancel to ~3e-5.
    for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/pg_clipfrac",
                "critic/vf_loss"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-5, abs=2e-6), key
    for key in ("actor/grad_norm", "critic/grad_norm"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=REORDER_RTOL), key
    assert metrics[0]["actor/grad_norm"] > 1e-3  # a real gradient: the update below moves weights
    for role in ("actor", "critic"):  # each optimizer step's gradients: summed over ranks in another order
        assert len(one[f"{role}_grads"]) == len(two[f"{role}_grads"]) == 2  # one step per mini-batch
        for step, (grads_two, grads_one) in enumerate(zip(two[f"{role}_grads"], one[f"{role}_grads"])):
            assert_close_reordered(grads_two, grads_one, f"{role} step {step}")
    moved = max(float((one["weights"][k] - one["before"][k]).abs().max()) for k in one["weights"])
    assert moved > 1e-5
    assert_same_adam_steps(one, two, cfg.rl.actor.optim.lr)
    # the weights streamed into each worker's engine, layer by layer, are the trained ones (float32 both)
    assert two["sync"]["rollout/logprob_diff_max"] < 1e-4


def assert_same_adam_steps(one: dict, two: dict, lr: float, k: float = 1000.0) -> None:
    """The actor's weights after its two Adam steps (betas 0.9, 0.999) agree wherever Adam's update is stable
    under the two runs' gradient differences.

    Adam moves an entry by lr * m / sqrt(v), about lr * sign(g) however small g is: where a gradient entry is
    ~0, the runs' float32 differences in it flip up to a whole lr-sized step. Where each step's entry is >= k
    times the runs' difference in it, the first-order change of m / sqrt(v) (each derivative <= ~2 / sqrt(v))
    is <= 2 / k at step 1 and 2.4 / k at step 2; the rounding of weights below 2 adds <= 2 ulps of 1.2e-7.
    """
    steps = [(hf_weights(g_one, None), hf_weights(g_two, None))
             for g_one, g_two in zip(one["actor_grads"], two["actor_grads"])]
    atol = 4.4 * lr / k + 2 * torch.finfo(torch.float32).eps
    num_stable = num_entries = 0
    for name in steps[0][0]:
        stable = torch.stack([g_one[name].abs() >= k * (g_two[name] - g_one[name]).abs()
                              for g_one, g_two in steps]).all(0)
        torch.testing.assert_close(two["weights"][name][stable], one["weights"][name][stable], rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")
        num_stable, num_entries = num_stable + int(stable.sum()), num_entries + stable.numel()
    # left out: entries within k x the runs' difference (~1e-6 of a tensor's largest entry) of 0, a small share
    assert num_stable > 0.99 * num_entries


def dpo_update(cfg, model_dir, pairs: Batch, num_workers: int, ref_logprobs: torch.Tensor | None = None) -> dict:
    """Online DPO's update as the driver dispatches it (`RLTrainer.update_actor`: pairs balanced as units, mini-batches
    of ppo_mini_batch_size pairs) on `num_workers` workers; `ref_logprobs` in `row` order replace the computed ones."""
    from stages.workers.actor_rollout import ActorRolloutWorker
    from stages.workers.group import Placement, WorkerGroup

    cfg = cfg.model_copy(update={"ray": RayConfig(num_devices_per_node=num_workers)})
    mini_rows = cfg.rl.actor.ppo_mini_batch_size * 2
    placement = Placement(cfg.ray, num_roles=1)
    actor = WorkerGroup(ActorRolloutWorker, cfg, model_dir, placement)
    try:
        pairs, _ = balance_batch(pairs, num_workers, mini_rows, unit_rows=2)
        t = pairs.tensors
        t["old_logprobs"], _ = actor.map_rows("compute_logprobs", pairs, mini_rows, "actor")
        t["ref_logprobs"], _ = actor.map_rows("compute_logprobs", pairs, mini_rows, "ref")
        out = {"ref_logprobs": t["ref_logprobs"][torch.argsort(torch.tensor(pairs.meta["row"]))]}
        if ref_logprobs is not None:
            t["ref_logprobs"] = ref_logprobs[torch.tensor(pairs.meta["row"])]
        actor.call("__ray_call__", keep_gradients, "actor")
        out["metrics"] = actor.split_call("update_actor", pairs, mini_rows)
        out["grads"] = actor.call_one("__ray_call__", kept_gradients)
    finally:
        actor.kill()
        placement.remove()
    return out


@pytest.mark.slow
def test_two_workers_train_online_dpo_pairs_as_one_worker(ray_cluster, tiny_model_dir, tiny_data_dir):
    """The pair batch through 1 and 2 workers (a pair per micro-batch at N = 1, other splits at N = 2): the same
    DPO loss, metrics and gradients, so no pair was split or mismatched across ranks or micro-batches."""
    from stages.rl_data import preference_batch

    cfg = load_config(None, TINY_OVERRIDES + RL + [
        "rl.rollout.engine=hf", "rl.algorithm.adv_estimator=online_dpo", "rl.actor.micro_batch_size=2",
        "rl.actor.optim.grad_clip=100"])
    batch, _ = a_batch(cfg, tiny_model_dir, tiny_data_dir)
    batch.tensors["token_level_rewards"] = token_level_scores(batch.tensors["rewards"], batch.response_mask)
    pairs, pair_metrics = preference_batch(batch, num_ranks=2)
    pairs.meta["row"] = list(range(len(pairs)))
    assert pair_metrics["dpo/num_pairs"] >= 6  # mini-batches of 4 pairs: a full one and a partial one
    one = dpo_update(cfg, str(tiny_model_dir), pairs, 1)
    two = dpo_update(cfg, str(tiny_model_dir), pairs, 2, ref_logprobs=one["ref_logprobs"])
    for key in ("actor/loss", "actor/dpo_loss", "dpo/rewards/chosen", "dpo/rewards/rejected", "dpo/rewards/margins",
                "dpo/rewards/accuracies", "dpo/logps/chosen", "dpo/logps/rejected"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=2e-6), key
    assert two["metrics"]["actor/grad_norm"] == pytest.approx(one["metrics"]["actor/grad_norm"], rel=REORDER_RTOL)
    assert one["metrics"]["actor/grad_norm"] > 1e-3
    assert len(one["grads"]) == len(two["grads"]) == 2  # one optimizer step per mini-batch
    for step, (grads_two, grads_one) in enumerate(zip(two["grads"], one["grads"])):
        assert_close_reordered(grads_two, grads_one, f"dpo step {step}")


# ---- 2. GRPO on two workers learns --------------------------------------------------------------------

DIGITS_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info):
    """Share of the response's characters that are digits: a dense reward a random tiny model can learn."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''


def rl_config(*overrides):
    return load_config(None, TINY_OVERRIDES + RL + ["ray.num_devices_per_node=2", *overrides])


def rl_checkpoints(cfg, tiny_model_dir, store_root) -> StoreCheckpoints:
    """As the flow's rl task keeps them: lineage to the init model, the model config for merging."""
    return StoreCheckpoints(ArtifactStore(str(store_root)), "rl-scale", cfg.rl.max_ckpt_to_keep,
                            {"init_model": str(tiny_model_dir)}, checkpoint_metadata(cfg.model))


def run_rl_steps(tiny_data_dir, tiny_model_dir, store_root, *overrides):
    from stages.rl import run_rl

    cfg = rl_config(*overrides)
    return run_rl(cfg, str(tiny_model_dir), tiny_data_dir, rl_checkpoints(cfg, tiny_model_dir, store_root),
                  RunTables(ArtifactStore(str(store_root)), "rl-scale"), Tracker([]))


def trained_weights(tiny_data_dir, tiny_model_dir, store_root, *overrides) -> dict[str, torch.Tensor]:
    """RL as run_rl runs it, then the full weights gathered from the live, sharded actor (HF names)."""
    from stages.rl import RLTrainer

    cfg = rl_config(*overrides)
    trainer = RLTrainer(cfg, str(tiny_model_dir), tiny_data_dir, rl_checkpoints(cfg, tiny_model_dir, store_root),
                        RunTables(ArtifactStore(str(store_root)), "rl-scale"), Tracker([]))
    try:
        trainer.fit()
        return trainer.actor.call_one("hf_state")
    finally:
        trainer.close()


def metric(root, name: str) -> list[float]:
    return [r["value"] for r in query(str(root), f"SELECT value FROM metrics WHERE name = '{name}' ORDER BY step")]


@pytest.mark.slow
def test_two_worker_grpo_with_vllm_raises_the_reward(ray_cluster, tiny_data_dir, tiny_model_dir, tmp_path):
    reward = tmp_path / "digits.py"
    reward.write_text(DIGITS_REWARD)
    root = tmp_path / "store"
    result = run_rl_steps(tiny_data_dir, tiny_model_dir, root, "rl.total_steps=8",
                          f"rl.reward.custom_path={reward}", "rl.actor.optim.lr=3e-3", "rl.actor.micro_batch_size=8",
                          "rl.val_before_train=false", "rl.test_freq=0", "rl.save_freq=0")
    assert result.num_steps == 8
    scores = metric(root, "critic/score/mean")
    first, last = sum(scores[:2]) / 2, sum(scores[-2:]) / 2
    assert last > first + 0.1, scores
    assert max(metric(root, "rollout/logprob_diff_max")) < 1e-3  # both engines follow the sharded trainer
    balanced = metric(root, "global_seqlen/balanced_max")
    assert len(balanced) == 8 and all(b <= m for b, m in zip(balanced, metric(root, "global_seqlen/max")))
    counts = query(str(root), "SELECT step, count(*) AS n FROM rollouts GROUP BY 1 ORDER BY 1")
    assert counts == [{"step": s, "n": 8 * 4} for s in range(1, 9)]


def engine_param_counts(model_dir, tensor_parallel_size: int, engine: str) -> list[int]:
    """Parameters held by each of 2 workers' engines (vLLM's CPU build counts only what stays a parameter after
    its kernel repacking: the comparison is between tensor parallel sizes)."""
    from stages.workers.actor_rollout import ActorRolloutWorker
    from stages.workers.group import Placement, WorkerGroup

    cfg = load_config(None, TINY_OVERRIDES + RL + ["ray.num_devices_per_node=2", f"rl.rollout.engine={engine}",
                                                   f"rl.rollout.tensor_model_parallel_size={tensor_parallel_size}"])
    placement = Placement(cfg.ray, num_roles=1)
    group = WorkerGroup(ActorRolloutWorker, cfg, str(model_dir), placement)
    try:
        return group.call_each("engine_param_count", [(), ()])
    finally:
        group.kill()
        placement.remove()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["vllm", "cuda"])
def test_tensor_parallel_rollout_engine_spans_two_workers(ray_cluster, tiny_data_dir, tiny_model_dir, tmp_path,
                                                          engine):
    # one engine over both workers (tensor parallel 2): both ranks get the same prompts and seed, the driver
    # keeps one copy of the outputs, and weights streamed from the FSDP shards load into each rank's half of the
    # engine (the engine's greedy tokens re-scored by the trainer agree)
    root = tmp_path / "store"
    result = run_rl_steps(tiny_data_dir, tiny_model_dir, root, "rl.total_steps=2", "rl.test_freq=0",
                          "rl.save_freq=0", "rl.rollout.tensor_model_parallel_size=2", f"rl.rollout.engine={engine}")
    assert result.num_steps == 2
    counts = query(str(root), "SELECT step, count(*) AS n, count(DISTINCT group_id) AS g FROM rollouts "
                              "GROUP BY 1 ORDER BY 1")
    assert counts == [{"step": s, "n": 8 * 4, "g": 8} for s in (1, 2)]  # each prompt sampled n times, once
    assert max(metric(root, "rollout/logprob_diff_max")) < 1e-3
    # each rank's engine holds about half of what an engine of its own holds: it really is split
    halves, wholes = engine_param_counts(tiny_model_dir, 2, engine), engine_param_counts(tiny_model_dir, 1, engine)
    assert all(0.4 * w < h < 0.7 * w for h, w in zip(halves, wholes)), (halves, wholes)
    validated = query(str(root), "SELECT step, count(*) AS n, count(DISTINCT prompt_index) AS p FROM validation "
                                 "GROUP BY 1 ORDER BY 1")
    assert validated == [{"step": s, "n": 8, "p": 8} for s in (0, 2)]  # before training and at the end


# ---- 3. sharded checkpoints, resumed on two workers ----------------------------------------------------


@pytest.mark.slow
def test_sharded_checkpoint_resumes_on_two_workers(ray_cluster, tiny_data_dir, tiny_model_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="stages.rl")
    root = tmp_path / "store"
    args = ("rl.rollout.engine=hf", "rl.algorithm.adv_estimator=gae", "rl.total_steps=3", "rl.save_freq=1",
            "rl.max_ckpt_to_keep=3", "rl.test_freq=0", "rl.val_before_train=false", "rl.actor.optim.lr=1e-3",
            "rl.critic.optim.lr=1e-3", "rl.rollout.temperature=1.5")
    trained = trained_weights(tiny_data_dir, tiny_model_dir, root, *args)

    store = ArtifactStore(str(root))
    versions = sorted(store.versions("checkpoint", "rl-scale"), key=lambda m: m.metadata["step"])
    assert [m.metadata["step"] for m in versions] == [1, 2, 3]
    last = store.get_dir(versions[-1].ref)
    for role in ("actor", "critic"):  # each rank wrote its own shard file and its generators
        assert sorted(p.name for p in (last / role).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                   "rng_rank0.pt", "rng_rank1.pt"]
    merged = hf_weights(read_checkpoint_model_state(last), lora_scale=None)  # one process, no process group
    assert merged.keys() == trained.keys()
    for name, value in trained.items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=0, msg=name)

    # lose the step-3 checkpoint: the rerun resumes from step 2 and ends where the first run ended
    store.delete(versions[-1].ref)
    scores = metric(root, "critic/score/mean")
    result = run_rl_steps(tiny_data_dir, tiny_model_dir, root, *args)
    assert "rl: resumed at step 2" in caplog.text
    assert store.manifest(result.checkpoint).metadata["step"] == 3
    merged_dir = merge_checkpoint(merge_source(store, result.checkpoint), tmp_path / "merged").out_dir
    resumed = load_model(merged_dir, load_config(None).model, trainable=False).state_dict()  # as a user gets it
    # Step 3 redone from the exact saved state (weights, optimizer, sampler) with the same batches, workers and
    # threads, in the same order: the same bits. (No tolerance would do instead: Adam turns any float difference
    # in a gradient entry near 0 into a difference of up to an lr-sized step.)
    for name, value in trained.items():
        assert torch.equal(resumed[name], value), name
    assert metric(root, "critic/score/mean") == scores
    assert all(math.isfinite(v) for v in metric(root, "critic/vf_loss"))
