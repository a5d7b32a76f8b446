"""fsdp.gather_full: FSDP2 shards of one layer back to full tensors in one all-gather, as full_tensor gives them."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

from stages.model import fsdp
from stages.model.fsdp import gather_full
from tests.conftest import free_port

RANKS = 3


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    torch.manual_seed(0)  # every rank builds the same module before sharding it
    module = nn.Module()
    module.even = nn.Parameter(torch.randn(6, 4))  # 2 rows a rank
    module.uneven = nn.Parameter(torch.randn(5, 3))  # 2, 2, 1 rows
    module.short = nn.Parameter(torch.randn(2, 2, 2))  # 1, 1, 0 rows: the last rank holds nothing
    module.vector = nn.Parameter(torch.randn(7))
    module.low = nn.Parameter(torch.randn(4, 5).bfloat16())  # another dtype: its own all-gather
    module.register_buffer("kept", torch.arange(3.0))  # not sharded: passes unchanged
    fully_shard(module)
    state = module.state_dict()
    calls = []
    gather_rows = fsdp._gather_rows
    fsdp._gather_rows = lambda shards: calls.append([(k, v.dtype) for k, v in shards.items()]) or gather_rows(shards)
    got = gather_full(state)
    one_each = list(calls)
    small = gather_full(state, max_bytes=100)  # several all-gathers per dtype: groups of <= 100 bytes
    cast_calls = len(calls)
    cast = dict(fsdp.iter_hf_weights(module, None, torch.bfloat16))  # the engine's dtype: cast before the gather
    sent = {key: dtype for group in calls[cast_calls:] for key, dtype in group}
    fsdp._gather_rows = gather_rows
    want = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    if rank == 0:
        torch.save({"got": got, "small": small, "want": want, "order": list(got), "one_each": one_each,
                    "grouped": calls[len(one_each):cast_calls], "cast": cast, "sent": sent}, out)
    dist.destroy_process_group()


def test_one_all_gather_gives_full_tensors_of_uneven_shards_and_dtypes(tmp_path):
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(free_port(), str(out)), nprocs=RANKS)
    result = torch.load(out)
    assert result["order"] == list(result["want"])  # the state dict's order, which the engine's loading follows
    assert _names(result["one_each"]) == [["even", "uneven", "short", "vector"], ["low"]]  # one all-gather per dtype
    # fp32: 96 + 60 + 32 + 28 bytes; bf16: 40
    assert _names(result["grouped"]) == [["even"], ["uneven", "short"], ["vector"], ["low"]]
    assert list(result["small"]) == list(result["want"])
    for key, want in result["want"].items():
        for got in (result["got"][key], result["small"][key]):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), key
    # iter_hf_weights in the engine's dtype: shards cast before the all-gather (half the bytes of fp32), the same
    # rounded values as casting the full tensors; the unsharded buffer passes the gather and comes out cast too
    assert result["sent"] == {key: torch.bfloat16 for key in ("even", "uneven", "short", "vector", "low")}
    for key, want in result["want"].items():
        assert torch.equal(result["cast"][key], want.bfloat16()), key


def _names(groups: list[list[tuple]]) -> list[list[str]]:
    """The tensor names of each recorded all-gather."""
    return [[key for key, _ in group] for group in groups]
