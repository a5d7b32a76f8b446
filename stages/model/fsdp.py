"""FSDP2 wrapping, full state dicts and LoRA merging for the RL workers.

Every trained module is sharded with `fully_shard` (per decoder layer, then the root), even on one
device, so one code path serves 1 or N workers. With vLLM in the same process, vLLM has already created
the default process group (gloo, world size 1 on CPU); otherwise we create it here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from stages.model.policy import hf_parts


def ensure_process_group(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port or 29500 + os.getpid() % 1000))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def shard(module: nn.Module, param_dtype: torch.dtype | None = None) -> nn.Module:
    """fully_shard each decoder layer, then the root (embeddings, norm, head and any value head)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
    body, _ = hf_parts(module.lm)
    for layer in body.layers:
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    return module


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU (every rank gets it with cpu_offload=False; rank 0 here)."""
    return get_model_state_dict(module, options=_FULL)


def load_full_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return get_optimizer_state_dict(module, optimizer, options=_FULL)


def load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))


def save_train_state(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Full (unsharded) weights, optimizer and LR-scheduler state of one trained module, in one file."""
    state = {"model": full_state_dict(module), "optimizer": optimizer_state(module, optimizer),
             "scheduler": scheduler.state_dict()}
    torch.save(state, path)


def load_train_state(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    state = torch.load(path, weights_only=False)
    load_full_state_dict(module, state["model"])
    load_optimizer_state(module, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])


def read_checkpoint_model_state(ckpt_dir: str | Path, role: str = "actor") -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict of `role` ('actor' or 'critic') in an RL checkpoint folder, on
    CPU, read in one process without a process group (what the merge stage consolidates).

    Keys are the trained module's (TokenLogprobs: `lm.` + HF or peft names; see `hf_weights`). The file is
    memory-mapped and loaded with `weights_only`, so the optimizer state next to the weights is not read.
    """
    path = Path(ckpt_dir) / f"{role}.pt"
    if not path.is_file():
        found = sorted(p.name for p in Path(ckpt_dir).iterdir()) if Path(ckpt_dir).is_dir() else []
        raise FileNotFoundError(f"{path} not found (folder holds {found}): not an RL checkpoint with a {role!r} "
                                "model; pass a checkpoint saved by the RL stage")
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)["model"]


_PEFT_PREFIX = re.compile(r"^(lm\.)?(base_model\.model\.)?")


def hf_weights(state: dict[str, torch.Tensor], lora_scale: float | None) -> dict[str, torch.Tensor]:
    """Plain HF parameter names -> tensors, with LoRA merged (W + scale * B @ A) when present.

    `state` is a TokenLogprobs state dict: keys start with `lm.` and, with peft, `base_model.model.`.
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
