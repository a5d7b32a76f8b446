"""Ulysses sequence parallelism (stages/model/sequence_parallel.py) computes what one rank computes alone.

Two gloo processes on 127.0.0.1 each run half of the packed row of the same micro-batch through a tiny Qwen2
(float32); their gathered logprobs and entropies must equal the unsplit single-process forward's, and their
parameter gradients, summed over the two ranks as FSDP2 sums them here, the unsplit gradients. Packed rows of
odd length (padded to a multiple of 2) with several sequences each; one model with fewer kv heads than ranks.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from infra.config import ConfigError, load_config
from infra.config_sections import TinyModelConfig
from stages.batch import Batch, build_batch
from stages.model.fsdp import init_process_group
from stages.model.packing import pack_rows
from stages.model.policy import TokenLogprobs
from stages.model.sequence_parallel import check_heads, sequence_parallel_group, split_packed
from stages.model.tiny import build_tiny_model
from stages.workers.group import WorkerGroup
from tests.conftest import free_port
from tests.tolerances import assert_close_reordered

RANKS = 2
MODELS = {"kv2": {"num_kv_heads": 2}, "kv1": {"num_kv_heads": 1}}  # kv1: fewer kv heads than ranks
LENGTHS = [((3, 6), (9, 1), (5, 11), (1, 4)), ((2, 3), (4, 9), (7, 1))]  # (prompt, response) per row


def a_batch(lengths, vocab: int):
    rng = random.Random(len(lengths))
    prompts = [[rng.randrange(10, vocab) for _ in range(p)] for p, _ in lengths]
    responses = [[rng.randrange(10, vocab) for _ in range(r)] for _, r in lengths]
    return build_batch(prompts, responses, [[0.0] * len(r) for r in responses], pad_token_id=0)


def loss_of(lp: torch.Tensor, ent: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A loss with a different weight on every token's logprob and entropy (a mix-up of tokens shows)."""
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    return (lp * w_lp * mask).sum() + (ent * w_ent * mask).sum()


def forward_backward(model_dir: Path, lengths, group) -> dict:
    """Logprobs, entropies (B, R) and parameter gradients of `loss_of`, with the rows split over `group`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    module = TokenLogprobs(model, chunk_tokens=5, pack=True, sequence_parallel=group)
    batch = a_batch(lengths, model.config.vocab_size)
    lp, ent = module(**batch.model_inputs(), temperature=0.9, with_entropy=True)
    loss_of(lp, ent, batch.response_mask).backward()
    return {"logprobs": lp.detach(), "entropy": ent.detach(),
            "grads": {name: p.grad for name, p in model.named_parameters()}}


def _rank(rank: int, port: int, model_dirs: dict, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    torch.set_num_threads(1)
    group = sequence_parallel_group(RANKS)
    results = {}
    for name, model_dir in model_dirs.items():
        for i, lengths in enumerate(LENGTHS):
            got = forward_backward(model_dir, lengths, group)
            for grad in got["grads"].values():
                dist.all_reduce(grad)  # FSDP2 sums gradients over ranks (stages/model/fsdp.py)
            results[name, i] = got
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    texts = [f"{a}+{b}={a + b}" for a in range(20) for b in range(20)]
    return {name: build_tiny_model(TinyModelConfig(hidden_size=128, num_layers=2, num_heads=4, **kv), texts, 0,
                                   tmp_path_factory.mktemp(name)) for name, kv in MODELS.items()}


@pytest.fixture(scope="module")
def split_results(model_dirs, tmp_path_factory) -> list[dict]:
    """Each rank's results of every (model, batch) case, computed once in two processes."""
    out = tmp_path_factory.mktemp("sp")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(free_port(), model_dirs, str(out)), nprocs=RANKS)
    return [torch.load(out / f"rank{r}.pt") for r in range(RANKS)]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("case", range(len(LENGTHS)))
def test_split_rows_give_the_unsplit_outputs_and_gradients(model_dirs, split_results, name, case):
    expected = forward_backward(model_dirs[name], LENGTHS[case], None)
    for rank, results in enumerate(split_results):
        got = results[name, case]
        # the same math with attention over other shapes: float32 rounding only (values of size ~6)
        torch.testing.assert_close(got["logprobs"], expected["logprobs"], rtol=0, atol=1e-5, msg=f"rank {rank}")
        torch.testing.assert_close(got["entropy"], expected["entropy"], rtol=0, atol=1e-5, msg=f"rank {rank}")
        assert_close_reordered(got["grads"], expected["grads"], f"rank {rank}")
    grads = expected["grads"]
    assert all(float(grads[k].abs().max()) > 0 for k in ("model.embed_tokens.weight",
                                                         "model.layers.0.self_attn.k_proj.weight"))


def test_split_rows_gather_back_into_the_row_order():
    # 3 sequences of 7, 4 and 6 tokens: T = 17 over 4 ranks -> 5 tokens each, 3 of padding (one more sequence)
    batch = a_batch(((3, 4), (2, 2), (1, 5)), vocab=50)
    t = batch.tensors
    packed = pack_rows(t["input_ids"], t["attention_mask"], batch.num_response_tokens)
    parts = [split_packed(packed, rank, 4) for rank in range(4)]
    assert parts[0]["cu_seqlens"].tolist() == [0, 7, 11, 17, 20] and parts[0]["max_seqlen"] == 7
    assert torch.equal(torch.cat([p["input_ids"] for p in parts])[:17], packed["input_ids"])
    assert torch.cat([p["position_ids"] for p in parts]).tolist()[-5:] == [4, 5, 0, 1, 2]  # 3 pads at 0, 1, 2
    # predicting states 2..5, 8, 9, 11..15: ranks hold 3, 3, 4 and 1 of them (local indices), padded to 4 each
    assert [p["predicting"].tolist() for p in parts] == [[2, 3, 4, 0], [0, 3, 4, 0], [1, 2, 3, 4], [0, 0, 0, 0]]
    gathered = torch.cat([p["predicting"] + 5 * rank for rank, p in enumerate(parts)])  # back to row indices
    assert torch.equal(gathered[parts[0]["gather_index"]], packed["predicting"])
    assert torch.equal(torch.cat([p["targets"] for p in parts])[parts[0]["gather_index"]], packed["targets"])


def test_the_ranks_of_a_group_get_the_same_rows_and_one_result_comes_back():
    # 4 ranks in groups of 2: 2 data-parallel ranks, each of an 8-row mini-batch's 4-row halves
    group = object.__new__(WorkerGroup)  # the dispatch only: no Ray actors
    group.world_size, group.sequence_parallel_size = 4, 2
    given = []
    group.call_each = lambda method, per_rank: given.extend(per_rank) or [
        (rows.tensors["input_ids"][:, 0] * 10 + rank,) for rank, (rows, *_) in enumerate(per_rank)]
    batch = Batch({"input_ids": torch.arange(16)[:, None]}, {"response": [f"text {i}" for i in range(16)]})
    (result,) = group.map_rows("f", batch, 8)
    assert [rows.tensors["input_ids"][:, 0].tolist() for rows, *_ in given] == [[0, 1, 2, 3, 8, 9, 10, 11]] * 2 + [
        [4, 5, 6, 7, 12, 13, 14, 15]] * 2
    assert all(rows.meta == {} for rows, *_ in given)  # the meta stays on the driver
    assert result.tolist() == [10 * x + (2 if x % 8 >= 4 else 0) for x in range(16)]  # from ranks 0 and 2


def test_settings_that_cannot_split_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size=2 splits packed rows: set "
                                          "rl.actor.use_remove_padding to true or null"):
        load_config(None, ["rl.actor.ulysses_sequence_parallel_size=2", "rl.actor.use_remove_padding=false"])
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=4 must divide the model's "
                                         "num_attention_heads=6"):
        check_heads(SimpleNamespace(num_attention_heads=6), 4)
    init_process_group()  # a world of one rank
    try:
        with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=2 must divide the number of ranks, 1"):
            sequence_parallel_group(2)
    finally:
        dist.destroy_process_group()
