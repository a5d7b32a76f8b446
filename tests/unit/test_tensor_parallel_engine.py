"""The cuda engine split over 2 gloo ranks (tensor parallel) generates what the engine computes alone.

Each rank keeps half of every layer's heads and MLP width, and sums the o and down projections over the group
(stages/rollout/cuda_model.py). On tiny float32 models of each architecture the two ranks must return the same
outputs as each other (without a seed too: they share the first rank's), the unsplit engine's greedy tokens,
and its logprobs to float32 rounding; a weight sync of full HF tensors must land as each rank's slice.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, Qwen2Config

from stages.rollout.base import SamplingParams
from stages.rollout.cuda_engine import CudaRolloutEngine
from stages.rollout.cuda_weights import DecoderShape
from tests.conftest import free_port
from tests.unit.test_cuda_engine import EOS, LOGPROB_ATOL, VOCAB, prompts, tiny_model

RANKS = 2
ARCHS = ["qwen2", "qwen3", "llama", "kv1"]  # llama: o bias (kept by rank 0); kv1: one kv head, shared by both ranks
GREEDY = SamplingParams(n=2, temperature=0.0, max_tokens=12, stop_token_ids=(-5,))
SAMPLED = SamplingParams(n=2, temperature=1.0, max_tokens=12)


def model_of(arch: str, seed: int = 0):
    if arch != "kv1":
        return tiny_model(arch, seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, intermediate_size=128, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=EOS, pad_token_id=3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for p in model.parameters():
            p.data.normal_(0, 0.2) if p.dim() > 1 else p.data.normal_(1.0, 0.1)
    return model.eval()


def outputs(engine, batch, params) -> list[tuple[list[int], list[float]]]:
    return [(o.response_ids, o.logprobs) for o in engine.generate(batch, params)]


def run_all(group) -> dict:
    results = {}
    for arch in ARCHS:
        engine = CudaRolloutEngine(model_of(arch), EOS, max_num_seqs=8, max_model_len=40, sync_every=2,
                                   tensor_parallel_group=group)
        results[arch, "greedy"] = outputs(engine, prompts(5), GREEDY)
        results[arch, "unseeded"] = outputs(engine, prompts(3), SAMPLED)
        engine.update_weights(model_of(arch, seed=1).state_dict())  # full tensors: each rank takes its slice
        results[arch, "synced"] = outputs(engine, prompts(5), GREEDY)
        results[arch, "params"] = engine.param_count()
    return results


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    torch.set_num_threads(1)
    torch.manual_seed(100 + rank)  # different generator states: unseeded sampling must still agree
    torch.save(run_all(dist.new_group([0, 1])), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def split_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(free_port(), str(out)), nprocs=RANKS)
    return [torch.load(out / f"rank{r}.pt") for r in range(RANKS)]


@pytest.fixture(scope="module")
def whole_results() -> dict:
    return run_all(None)


def assert_same_tokens_close_logprobs(got, want, what: str) -> None:
    assert [ids for ids, _ in got] == [ids for ids, _ in want], what
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=LOGPROB_ATOL, msg=what)


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_generate_what_one_engine_generates(split_results, whole_results, arch):
    first, second = split_results
    for case in ("greedy", "unseeded", "synced"):
        assert first[arch, case] == second[arch, case], f"{arch} {case}: the ranks disagree"
    for case in ("greedy", "synced"):
        assert_same_tokens_close_logprobs(first[arch, case], whole_results[arch, case], f"{arch} {case}")
    assert first[arch, "synced"] != first[arch, "greedy"]  # the sync changed the weights
    assert first[arch, "params"] < 0.8 * whole_results[arch, "params"]  # each rank holds a share, not a copy


def test_a_size_that_does_not_split_the_model_is_refused():
    shape = DecoderShape.from_config(tiny_model("qwen2").config)  # 4 heads, 2 kv heads, intermediate 128
    assert shape.sharded(4).num_kv_heads == 1 and shape.sharded(4).num_heads == 1
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=3 must divide the model's "
                                         r"num_attention_heads=4, num_key_value_heads=2, intermediate_size=128"):
        shape.sharded(3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_capture_the_groups_all_reduce():
    """On a GPU the all-reduces are captured in the decode step's CUDA graphs: a group of one rank (nccl) must give
    what no group gives (several GPUs: bench/gpu_tp_rollout.py)."""
    from stages.model.fsdp import init_process_group

    init_process_group()  # a world of one rank
    try:
        model = tiny_model().to(torch.bfloat16).cuda()
        alone = CudaRolloutEngine(model, EOS, max_num_seqs=8, max_model_len=40)
        grouped = CudaRolloutEngine(model, EOS, max_num_seqs=8, max_model_len=40,
                                    tensor_parallel_group=dist.new_group([0]))
        assert grouped.use_cuda_graphs and grouped.decoder.tp_group is not None
        assert outputs(grouped, prompts(5), GREEDY) == outputs(alone, prompts(5), GREEDY)
        assert outputs(grouped, prompts(5), SAMPLED) != outputs(grouped, prompts(5), SAMPLED)  # unseeded: fresh draws
    finally:
        dist.destroy_process_group()
