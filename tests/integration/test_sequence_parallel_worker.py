"""The actor worker with Ulysses sequence parallelism computes what a worker without it computes.

Gloo ranks in sequence-parallel groups of 2 (rl.actor.ulysses_sequence_parallel_size=2; 2 ranks: one
data-parallel rank, 4 ranks: two), each given its group's rows as WorkerGroup dispatches them, against one rank
alone, both on packed rows, the same batch: equal old/ref logprobs and entropies, loss metrics, gradient norms,
each optimizer step's gradients, and weights after the update. Spawned processes (no Ray), each an
ActorRolloutWorker of that world.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from infra.config import load_config
from stages.batch import Batch, gather_rows, rank_rows
from stages.workers.actor_rollout import ActorRolloutWorker
from tests.conftest import free_port
from tests.integration.test_actor_worker import SETTINGS, a_batch, vocab
from tests.integration.test_scale import assert_same_adam_steps
from tests.tolerances import REORDER_RTOL, assert_close_reordered

PACKED = SETTINGS + ["rl.actor.use_remove_padding=true", "rl.actor.entropy_coeff=0.01"]
MINI_ROWS = 8  # ppo_mini_batch_size 2 x n 4: the 16 rows make two optimizer steps


def keep_gradients(w: ActorRolloutWorker) -> list[dict[str, torch.Tensor]]:
    """The full gradients of each optimizer step, gathered before it steps (a collective on every rank)."""
    names = {param: name for name, param in w.actor.named_parameters()}
    kept: list[dict[str, torch.Tensor]] = []
    w.trainer.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: kept.append(
        {names[p]: p.grad.full_tensor() for group in optimizer.param_groups for p in group["params"]}))
    return kept


def run_worker(w: ActorRolloutWorker, batch: Batch) -> dict:
    """Old and ref logprobs, then one update on them: outputs, metrics, gradients, weights before and after."""
    out, t = {"before": {k: v.clone() for k, v in w.hf_state().items()}}, batch.tensors  # may alias the weights
    t["old_logprobs"], out["entropy"] = w.compute_logprobs(batch, "actor", True)
    t["ref_logprobs"], _ = w.compute_logprobs(batch, "ref")
    grads = keep_gradients(w)
    out.update(old_logprobs=t["old_logprobs"], ref_logprobs=t["ref_logprobs"], metrics=w.update_actor(batch))
    return {**out, "grads": grads, "weights": w.hf_state()}


def _rank(rank: int, world: int, port: int, model_dir: str, batch: Batch, out: str) -> None:
    """Rank `rank` of `world` in groups of 2: the rows of its group's data-parallel rank, as WorkerGroup sends them."""
    torch.set_num_threads(1)
    cfg = load_config(None, PACKED + ["rl.actor.ulysses_sequence_parallel_size=2", f"ray.num_devices_per_node={world}"])
    w = ActorRolloutWorker(cfg, model_dir, rank, world, "127.0.0.1", port)
    rows = rank_rows(len(batch), world // 2, MINI_ROWS)[rank // 2]
    torch.save(run_worker(w, batch.select(rows)), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4], ids=["1dp-x-2sp", "2dp-x-2sp"])
def test_sequence_parallel_ranks_update_as_one_rank(tiny_model_dir, tmp_path, world):
    torch.manual_seed(0)
    batch = a_batch(vocab(tiny_model_dir))  # random advantages: one batch for both runs
    mp.spawn(_rank, args=(world, free_port(), str(tiny_model_dir), batch, str(tmp_path)), nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    split = ranks[0]
    shards = rank_rows(len(batch), world // 2, MINI_ROWS)
    one = run_worker(ActorRolloutWorker(load_config(None, PACKED), str(tiny_model_dir)), batch)

    for key in ("old_logprobs", "entropy", "ref_logprobs"):  # float32 rounding of other shapes only
        assert all(torch.equal(ranks[r][key], ranks[r + 1][key]) for r in range(0, world, 2))  # a group agrees
        got = gather_rows([ranks[r][key] for r in range(0, world, 2)], shards)
        torch.testing.assert_close(got, one[key], rtol=0, atol=1e-5, msg=key)
    for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/pg_clipfrac"):
        assert split["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-6), key
    assert split["metrics"]["actor/grad_norm"] == pytest.approx(one["metrics"]["actor/grad_norm"], rel=REORDER_RTOL)
    assert one["metrics"]["actor/grad_norm"] > 1e-3
    assert len(split["grads"]) == len(one["grads"]) == 2  # two mini-batches, two optimizer steps
    for step, (got, expected) in enumerate(zip(split["grads"], one["grads"])):
        assert_close_reordered(got, expected, f"step {step}")
    moved = max(float((one["weights"][k] - one["before"][k]).abs().max()) for k in one["weights"])
    assert moved > 1e-4
    # Adam's steps, wherever float32 differences in a gradient entry near 0 cannot flip them (test_scale.py)
    assert_same_adam_steps({"actor_grads": one["grads"], "weights": one["weights"]},
                           {"actor_grads": split["grads"], "weights": split["weights"]}, lr=1e-3)


@pytest.fixture(autouse=True)
def _one_rank_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
