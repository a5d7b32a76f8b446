"""The critic's value model under FSDP2, in-process (a world of one rank), as the critic worker shards it.

FSDP2 gathers the root module's weights again for backward in a hook on the root's output. A view returned as
that output loses the hook to any in-place op on it, and with the weights resharded after forward (the
multi-device default) backward then reads freed weights. The sharded model must compute the plain model's
gradients even when the loss modifies the values in place, without FSDP2's warning about a view output.
"""

import copy
import random
import warnings

import pytest
import torch

from infra.config import load_config
from stages.batch import Batch, build_batch
from stages.core import clipped_value_loss
from stages.model.fsdp import init_process_group, shard
from stages.model.loading import load_model
from stages.model.policy import ValueModel
from tests.conftest import TINY_OVERRIDES
from tests.tolerances import assert_close_reordered


def a_batch(vocab: int) -> Batch:
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(3, 8))] for _ in range(6)]
    responses = [[rng.randrange(10, vocab) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    return build_batch(prompts, responses, [[0.0] * len(r) for r in responses], pad_token_id=0)


def value_loss_gradients(model: torch.nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """Full gradients of the clipped value loss, with the padding's values zeroed in place first."""
    mask = batch.response_mask
    values = model(**batch.model_inputs())
    values.masked_fill_(~mask, 0.0)
    returns = torch.linspace(-1.0, 1.0, mask.numel()).view(mask.shape)
    loss, _ = clipped_value_loss(values, torch.zeros_like(values), returns, mask, cliprange_value=0.5)
    loss.backward()
    return {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for name, p in model.named_parameters()}


@pytest.fixture(autouse=True)
def _one_rank_world():
    init_process_group()
    yield
    torch.distributed.destroy_process_group()


def test_sharded_value_model_computes_the_plain_gradients(tiny_model_dir):
    model_cfg = load_config(None, TINY_OVERRIDES).model.model_copy(
        update={"lora": None, "gradient_checkpointing": False, "dtype": "float32"})  # as CriticWorker loads it
    plain = ValueModel(load_model(tiny_model_dir, model_cfg))
    torch.nn.init.normal_(plain.value_head.weight, std=0.1)  # zero-initialised, it would pass no gradient on
    sharded = shard(copy.deepcopy(plain), torch.float32, reshard_after_forward=True)
    batch = a_batch(plain.lm.config.vocab_size)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*returned a view tensor")
        got = value_loss_gradients(sharded, batch)
    expected = value_loss_gradients(plain, batch)
    assert all(float(expected[name].abs().max()) > 0 for name in
               ("value_head.weight", "lm.model.layers.1.mlp.down_proj.weight", "lm.model.embed_tokens.weight"))
    assert_close_reordered(got, expected)  # one rank: the same sums, but on gathered copies of the weights
