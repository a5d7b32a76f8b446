"""The actor worker's FSDP2 settings, in-process (no Ray): one world of one rank, the `hf` engine.

- The gradient reduced once per mini-batch gives the same update as one reduced after every micro-batch.
- With `reshard_after_forward` off (the one-device default), inference passes leave no gathered weights
  behind (the rollout engine shares the device with them).
- `rl.actor.optimizer_offload`: AdamW's moments emptied between steps, the same update.
- `rl.actor.gradient_checkpointing` (automatic: off on CPU): recomputed activations, the same update.
- `model.dtype=bfloat16`: the trained weights stay fp32 (optimizer updates of 1e-6 are not lost to bf16
  rounding), the forward computes in bf16, the frozen reference is stored in bf16.
"""

import random

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoConfig

from infra.config import load_config
from stages.batch import Batch, build_batch
from stages.workers.actor_rollout import ActorRolloutWorker
from tests.conftest import TINY_OVERRIDES

SETTINGS = TINY_OVERRIDES + ["rl.enabled=true", "rl.rollout.engine=hf", "rl.train_batch_size=4", "rl.rollout.n=4",
                             "rl.actor.ppo_mini_batch_size=2", "rl.actor.micro_batch_size=3", "rl.actor.optim.lr=1e-3",
                             "rl.actor.optim.grad_clip=100", "rl.actor.use_kl_loss=true"]


def vocab(model_dir) -> int:
    return AutoConfig.from_pretrained(model_dir).vocab_size


def a_batch(vocab: int) -> Batch:
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(3, 8))] for _ in range(16)]
    responses = [[rng.randrange(10, vocab) for _ in range(rng.randint(1, 12))] for _ in range(16)]
    batch = build_batch(prompts, responses, [[-1.0] * len(r) for r in responses], pad_token_id=0)
    batch.tensors["advantages"] = torch.randn(batch.response_mask.shape) * batch.response_mask
    return batch


def worker(model_dir, *overrides) -> ActorRolloutWorker:
    return ActorRolloutWorker(load_config(None, SETTINGS + list(overrides)), str(model_dir))


def trained_weights(w: ActorRolloutWorker, batch: Batch) -> dict[str, torch.Tensor]:
    t = batch.tensors
    t["old_logprobs"], _ = w.compute_logprobs(batch)
    t["ref_logprobs"], _ = w.compute_logprobs(batch, "ref")
    metrics = w.update_actor(batch)
    assert metrics["actor/grad_norm"] > 1e-3
    return w.hf_state()


@pytest.mark.parametrize("lora", [[], ["model.lora.rank=8"]], ids=["full", "lora"])
def test_one_gradient_sync_per_mini_batch_gives_the_same_update(tiny_model_dir, lora):
    # with LoRA the reference is the actor with its adapter disabled: the same FSDP2 modules, run without
    # gradient first, then trained (weights left gathered by the no-grad pass would carry no gradient)
    batch = a_batch(vocab(tiny_model_dir))
    once = trained_weights(worker(tiny_model_dir, *lora), batch)  # the default on one device
    every = trained_weights(worker(tiny_model_dir, *lora, "rl.actor.grad_sync_every_micro_batch=true",
                                   "rl.actor.reshard_after_forward=true"), batch)
    before = worker(tiny_model_dir, *lora).hf_state()
    assert max(float((once[k] - before[k]).abs().max()) for k in once) > 1e-4  # the update moved the weights
    # The same bits: at one rank the reduce is a copy, and both add the micro-batches' gradients in the same
    # order. (No tolerance would do instead: Adam turns any float difference in a gradient entry near 0 into a
    # difference of up to an lr-sized step.)
    for name, value in once.items():
        assert torch.equal(every[name], value), name


def test_inference_passes_leave_the_weights_sharded(tiny_model_dir):
    w = worker(tiny_model_dir)  # reshard_after_forward is off on one device
    w.compute_logprobs(a_batch(vocab(tiny_model_dir)))
    assert all(isinstance(p, DTensor) for p in w.actor.parameters())
    assert all(isinstance(p, DTensor) for p in w.ref.parameters())


def test_bf16_compute_keeps_fp32_master_weights(tiny_model_dir):
    w = worker(tiny_model_dir, "model.dtype=bfloat16")
    assert {p.dtype for p in w.actor.parameters()} == {torch.float32}
    assert {p.dtype for p in w.ref.parameters()} == {torch.bfloat16}
    batch = a_batch(vocab(tiny_model_dir))
    lp, _ = w.compute_logprobs(batch)
    fp32, _ = worker(tiny_model_dir).compute_logprobs(batch)
    mask = batch.response_mask
    gap = float(((lp - fp32).abs() * mask).max())
    # computed in bf16 (relative rounding 2^-9 = 0.2%): logprobs of about -6 move by ~0.01, never by 0
    assert 0 < gap < 0.1
    w.update_actor(Batch({**batch.tensors, "old_logprobs": lp, "ref_logprobs": lp}, batch.meta))
    assert {p.dtype for p in w.actor.parameters()} == {torch.float32}
    assert {s["exp_avg"].dtype for s in w.trainer.optimizer.state.values()} == {torch.float32}


def emptied_moments(w: ActorRolloutWorker) -> bool:
    moments = [v.to_local() for s in w.trainer.optimizer.state.values() for k, v in s.items() if k != "step"]
    return bool(moments) and all(m.untyped_storage().nbytes() == 0 for m in moments)


def test_optimizer_offload_gives_the_same_update(tiny_model_dir, tmp_path):
    batch = a_batch(vocab(tiny_model_dir))
    w = worker(tiny_model_dir, "rl.actor.optimizer_offload=true")
    offloaded = [trained_weights(w, batch) for _ in range(2)][-1]  # the second step reloads the moments
    assert emptied_moments(w)  # DTensor state
    w.save_checkpoint(str(tmp_path / "ckpt"))  # reads the moments back, then empties them again
    assert emptied_moments(w)
    w.load_checkpoint(str(tmp_path / "ckpt"))
    assert emptied_moments(w)
    resumed = trained_weights(w, batch)
    torch.distributed.destroy_process_group()
    plain = worker(tiny_model_dir)
    expected = [trained_weights(plain, batch) for _ in range(3)]
    for name, value in expected[1].items():
        assert torch.equal(offloaded[name], value), name
        assert torch.equal(resumed[name], expected[2][name]), name


@pytest.mark.parametrize("lora", [[], ["model.lora.rank=8"]], ids=["full", "lora"])
def test_gradient_checkpointing_gives_the_same_update(tiny_model_dir, lora):
    batch = a_batch(vocab(tiny_model_dir))
    w = worker(tiny_model_dir, *lora, "rl.actor.gradient_checkpointing=true")
    assert w.actor.lm.get_base_model().is_gradient_checkpointing if lora else w.actor.lm.is_gradient_checkpointing
    recomputed = trained_weights(w, batch)
    torch.distributed.destroy_process_group()
    plain = worker(tiny_model_dir, *lora)  # automatic: off on CPU
    assert plain.automatic_settings()["rl.actor.gradient_checkpointing"] is False
    kept = trained_weights(plain, batch)
    for name, value in kept.items():
        torch.testing.assert_close(recomputed[name], value, rtol=0, atol=1e-6)


@pytest.fixture(autouse=True)
def _one_rank_world():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
