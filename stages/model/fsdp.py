"""FSDP2 for the RL workers: the process group, sharding, weight streaming to the engine, checkpoints.

N worker processes (one per device) form one torch.distributed world (gloo on CPU, nccl on GPU) that
FSDP2 shards over; the worker group creates it *before* the in-process vLLM engine, which then joins it
as an "external launcher" with tensor parallel size 1, so each engine generates on its own and keeps a
world of one for itself (its tensor-parallel groups hold one rank each). Every trained module is sharded
with `fully_shard` (per decoder layer, then the root), even at N = 1, so one code path serves any N.

Gradients are *summed* over ranks, not averaged (FSDP2's default): each rank's loss is already divided
by the global token/sequence counts of the mini-batch (stages/core `loss_denominators`, summed over
ranks), so the sum is the gradient of the global loss, the same at any N.

Checkpoints are torch.distributed.checkpoint (DCP) folders: each rank writes its shards of the weights
and the optimizer state, rank 0 the metadata; they load back on the same N. `read_checkpoint_model_state`
reads the full weights from such a folder in one process without a process group (the merge stage). Both
loads go through stages/model/safe_load.py, so a checkpoint's pickles (DCP's metadata, its non-tensor values)
cannot run code.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from stages.model.policy import hf_parts
from stages.model.safe_load import (
    SafeEmptyStateDictLoadPlanner,
    SafeFileSystemReader,
    SafeLoadPlanner,
    refusals_raised,
)

PG_TIMEOUT = timedelta(minutes=30)  # a rank waits this long in a collective for a slower (generating) rank


def init_process_group(rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1",
                       master_port: int | None = None) -> None:
    """Join the workers' world (gloo on CPU, nccl on GPU); `master_port` None: a free local port (world of
    one). The env vars are also what vLLM's external-launcher mode reads (RANK, LOCAL_RANK): each worker
    sees one device, so its local rank is 0."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"this process is already in a torch.distributed world of {dist.get_world_size()} "
                               f"ranks, not {world_size}")
        return
    if master_port is None:
        if world_size != 1:
            raise ValueError(f"a world of {world_size} ranks needs the rendezvous master_port of rank 0")
        with socket.socket() as sock:
            sock.bind((master_addr, 0))
            master_port = sock.getsockname()[1]
    os.environ.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0"})
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=PG_TIMEOUT)


def all_reduce(value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """`value` reduced over the workers' world (unchanged in a world of one), on its own device: the reduction runs
    on the GPU under nccl, which has no CPU tensors."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else value.device
    reduced = value.detach().to(device).clone()
    dist.all_reduce(reduced, op=op)
    return reduced.to(value.device)


def shard(module: nn.Module, param_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
          offload: bool = False) -> nn.Module:
    """fully_shard each decoder layer, then the root (embeddings, norm, head and any value head); gradients
    are summed over ranks (see the module docstring). param_dtype: compute in it (mixed precision: the
    sharded parameters keep their dtype, fp32 master weights for a trained model); reshard_after_forward:
    free each layer's gathered weights after forward (see `rl.actor.reshard_after_forward`; `reshard` frees
    them after a forward without backward); offload: FSDP2's CPU offload (parameters, gradients and optimizer state
    in host memory; on CUDA only)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    kwargs.update({"mp_policy": policy} if policy else {})
    if offload and device == "cuda":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    body, _ = hf_parts(module.lm)
    units = [*body.layers, module]
    for unit in units:
        fully_shard(unit, **kwargs)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no AVG / PREMUL_SUM
    return module


def reshard(module: nn.Module) -> None:
    """Free the gathered weights a forward without backward leaves behind when reshard_after_forward is off
    (a no-grad pass would otherwise keep the whole model unsharded next to the rollout engine)."""
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU, on rank 0 (other ranks get an empty dict); a collective."""
    return get_model_state_dict(module, options=_FULL)


_LAYER = re.compile(r"\.layers\.(\d+)\.")
_LORA_PART = re.compile(r"\.(base_layer|lora_[AB]\.default)\.")  # peft's parts of one wrapped module


def iter_hf_weights(module: nn.Module, lora_scale: float | None,
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs, gathered one decoder layer at a time (a collective: every rank iterates
    in the same order), LoRA merged. No rank ever holds more than one layer of unsharded weights besides its
    shards, so an engine on the same device fills itself without a second full copy of the model. `dtype`: the
    floating tensors come in it (the engines compute in `model.dtype`; None: as stored); without LoRA each rank casts
    its shard before the all-gather (fp32 master weights would put twice the bytes on the wire for the same rounded
    result), with LoRA the merge is done in the stored dtype first. An fp8 engine quantises what it gets: these
    `dtype` tensors, as the weight pushes to rollout workers on other GPUs always sent."""
    state = module.state_dict()  # DTensor shards (no copy)
    buckets: dict[str, list[str]] = {}
    for key in state:  # one bucket per decoder layer, else per module: a LoRA-wrapped lm_head's parts together
        match = _LAYER.search(key)
        buckets.setdefault(f"layer{match.group(1)}" if match else _LORA_PART.sub(".", key), []).append(key)
    early = dtype if lora_scale is None else None
    for keys in buckets.values():
        full = gather_full({k: _cast(state[k], early) for k in keys})
        yield from ((name, _cast(value, dtype)) for name, value in hf_weights(full, lora_scale).items())
        del full


def _cast(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A floating tensor (a DTensor shard too) in `dtype`; others, and dtype None, unchanged."""
    return value.to(dtype) if dtype is not None and value.is_floating_point() else value


GATHER_BYTES = 1 << 30  # full bytes per all-gather of `gather_full`: its transient memory is about twice that


def gather_full(values: dict[str, torch.Tensor], max_bytes: int = GATHER_BYTES) -> dict[str, torch.Tensor]:
    """Full tensors of FSDP2 shards (dim-0 shards of a 1-D mesh), gathered in one all-gather per dtype instead
    of one per tensor (a 0.5B model's sync ran ~300 collectives, 0.32 s on 4 H100s against 0.14 s on one);
    a dtype's tensors of more than `max_bytes` in all (a large model's layer) take several, of <= `max_bytes`
    each unless one tensor is larger. Each rank's shard holds rows [r c, (r + 1) c) of c = ceil(rows / world)
    (torch.chunk's split); shards are padded to c rows, sent as one flat tensor and cut back to the full rows.
    Other tensors pass unchanged."""
    out = {k: v for k, v in values.items() if not _sharded_on_rows(v)}
    by_dtype: dict[torch.dtype, dict[str, torch.Tensor]] = {}
    for key, value in values.items():  # in the same order on every rank: the collectives must match
        if key not in out:
            by_dtype.setdefault(value.dtype, {})[key] = value
    for shards in by_dtype.values():
        for part in _byte_groups(shards, max_bytes):
            out.update(_gather_rows(part))
    return {k: out[k] for k in values}


def _byte_groups(values: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive runs of `values` of <= `max_bytes` (full sizes) each; a larger tensor is a run of its own."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for key, value in values.items():
        size = value.numel() * value.element_size()
        if groups[-1] and filled + size > max_bytes:
            groups.append({})
            filled = 0
        groups[-1][key] = value
        filled += size
    return groups


def _sharded_on_rows(value: torch.Tensor) -> bool:
    return isinstance(value, DTensor) and value.device_mesh.ndim == 1 and tuple(value.placements) == (Shard(0),)


def _gather_rows(shards: dict[str, DTensor]) -> dict[str, torch.Tensor]:
    first = next(iter(shards.values()))
    group, world = first.device_mesh.get_group(), first.device_mesh.size()
    device = "cuda" if torch.cuda.is_available() else first.to_local().device  # offloaded shards: NCCL on the GPU
    blocks = {k: -(-v.shape[0] // world) * math.prod(v.shape[1:]) for k, v in shards.items()}  # padded shard sizes
    sent = torch.zeros(sum(blocks.values()), dtype=first.dtype, device=device)
    offset = 0
    for key, value in shards.items():
        local = value.to_local().reshape(-1)
        sent[offset:offset + local.numel()].copy_(local)
        offset += blocks[key]
    received = torch.empty(world * sent.numel(), dtype=sent.dtype, device=device)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13: renamed
    all_gather(received, sent, group=group)
    received = received.view(world, -1)
    full, offset = {}, 0
    for key, block in blocks.items():
        shape = shards[key].shape
        full[key] = received[:, offset:offset + block].reshape(-1, *shape[1:])[: shape[0]]
        offset += block
    return full


# ---- checkpoints (DCP) ----------------------------------------------------------------------------


UNSTEPPED = "optimizer_unstepped"  # a file in the DCP folder: saved before the optimizer's first step


def save_train_state(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Sharded weights and optimizer state (each rank its own shards) plus the LR scheduler, in a DCP folder.

    A collective: every rank calls it with the same `folder` (on a file system all ranks see). torch's
    `get_optimizer_state_dict` creates the state of an optimizer that has not stepped by stepping it once with lr 0:
    AdamW's counter then read 1, and the first real update was ~0.74x (bias correction of step 2). Such a save
    (an actor saved during the critic's warmup) forgets that state again and says so in `UNSTEPPED`."""
    unstepped = not optimizer.state
    state = {"model": get_model_state_dict(module), "optimizer": get_optimizer_state_dict(module, optimizer),
             "scheduler": scheduler.state_dict()}
    dcp.save(state, checkpoint_id=str(folder))
    if unstepped:
        optimizer.state.clear()  # made again at the first step (OffloadedAdamW's host copies are refilled then)
        if not dist.is_initialized() or dist.get_rank() == 0:
            (Path(folder) / UNSTEPPED).touch()


def load_train_state(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Load what `save_train_state` wrote, resharded in place onto this world's shards."""
    if not (Path(folder) / ".metadata").is_file():
        raise FileNotFoundError(f"{folder} is not a sharded (DCP) checkpoint; it was written by an older version "
                                "of the RL stage: start a new run (rl.resume_mode=disable)")
    state = {"model": get_model_state_dict(module), "optimizer": get_optimizer_state_dict(module, optimizer),
             "scheduler": scheduler.state_dict()}
    with refusals_raised():
        dcp.load(state, storage_reader=SafeFileSystemReader(str(folder)), planner=SafeLoadPlanner(folder=folder))
    set_model_state_dict(module, state["model"])
    set_optimizer_state_dict(module, optimizer, state["optimizer"])
    if (Path(folder) / UNSTEPPED).is_file():
        optimizer.state.clear()  # saved before its first step: made again at that step
    scheduler.load_state_dict(state["scheduler"])


def read_checkpoint_model_state(ckpt_dir: str | Path, role: str = "actor") -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict of `role` ('actor' or 'critic') in an RL checkpoint folder, on
    CPU, read in one process without a process group (what the merge stage consolidates).

    Keys are the trained module's (TokenLogprobs: `lm.` + HF or peft names; see `hf_weights`). Only the
    weights are read from the role's DCP folder (written by any number of ranks), not the optimizer state.
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = Path(ckpt_dir) / role
    if not (folder / ".metadata").is_file():
        found = sorted(p.name for p in Path(ckpt_dir).iterdir()) if Path(ckpt_dir).is_dir() else []
        raise FileNotFoundError(f"{folder}/.metadata not found (folder holds {found}): not an RL checkpoint with "
                                f"a {role!r} model; pass a checkpoint saved by the RL stage")
    state: dict = {}
    with refusals_raised():
        _load_state_dict(state, storage_reader=SafeFileSystemReader(str(folder)),
                         planner=SafeEmptyStateDictLoadPlanner(keys={"model"}, folder=folder), no_dist=True)
    return state["model"]


_PEFT_PREFIX = re.compile(r"^(lm\.)?(base_model\.model\.)?")


def hf_weights(state: dict[str, torch.Tensor], lora_scale: float | None) -> dict[str, torch.Tensor]:
    """Plain HF parameter names -> tensors, with LoRA merged (W + scale * B @ A) when present.

    `state` is a TokenLogprobs state dict (or any part of one holding whole LoRA modules): keys start with
    `lm.` and, with peft, `base_model.model.`.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = _PEFT_PREFIX.sub("", key)
        if ".lora_" in name:
            continue
        if lora_scale is not None and key.endswith(".base_layer.weight"):
            a = state[key.replace(".base_layer.weight", ".lora_A.default.weight")]
            b = state[key.replace(".base_layer.weight", ".lora_B.default.weight")]
            value = value + lora_scale * (b.float() @ a.float()).to(value.dtype)
        out[name.replace(".base_layer.", ".")] = value
    return out
