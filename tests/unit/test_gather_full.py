"""fsdp.gather_full: FSDP2 shards of one layer back to full tensors in one all-gather, as full_tensor gives them."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

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
    got = gather_full(state)
    want = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    if rank == 0:
        torch.save({"got": got, "want": want, "order": list(got)}, out)
    dist.destroy_process_group()


def test_one_all_gather_gives_full_tensors_of_uneven_shards_and_dtypes(tmp_path):
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(free_port(), str(out)), nprocs=RANKS)
    result = torch.load(out)
    assert result["order"] == list(result["want"])  # the state dict's order, which the engine's loading follows
    for key, want in result["want"].items():
        got = result["got"][key]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), key
