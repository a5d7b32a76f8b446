"""Weights from the trainer to rollout workers on devices of their own (the asynchronous modes, stages/rl_async.py).

The trainer's rank 0 and the R rollout workers form one process group of their own (rank 0 = the trainer), made
from a TCP store at a rendezvous address the driver picks: NCCL when the trainer is on a GPU, gloo on CPU. It is
not the default world of either side (each keeps its own for FSDP2 and vLLM). A push is one broadcast per tensor
in the order `iter_hf_weights` yields them (gathered one decoder layer at a time on the trainer, LoRA merged), so
the receivers know every name, shape and dtype beforehand (`weight_meta`, asked once) and load the tensors into
their engine as they arrive: neither side holds a second full copy of the model.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

WeightMeta = list[tuple[str, tuple[int, ...], str]]  # (HF name, shape, dtype name) in push order


class WeightGroup:
    """One rank's end of the trainer -> rollout workers broadcast group."""

    def __init__(self, addr: str, port: int, rank: int, size: int, device: torch.device, timeout_s: float):
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(addr, port, size, rank == 0, timeout=timeout)  # kept: the group reads it
        prefix = dist.PrefixStore("rlpipe-weights", self.store)
        if device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(prefix, rank, size)
        else:
            self.group = dist.ProcessGroupGloo(prefix, rank, size, timeout)
        self.device = device

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast every tensor (rank 0); -> the bytes sent."""
        sent = 0
        for _, tensor in weights:
            tensor = tensor.detach().to(self.device).contiguous()
            self._broadcast(tensor)
            sent += tensor.numel() * tensor.element_size()
        return sent

    def close(self) -> None:
        """Leave the group before the process ends (NCCL's watchdog otherwise reports the store's owner gone)."""
        self._broadcast(torch.zeros(1, device=self.device))  # every rank gets here before anyone leaves
        if hasattr(self.group, "shutdown"):
            self.group.shutdown()

    def receive(self, meta: WeightMeta) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs as they arrive (ranks > 0), for an engine's `update_weights`."""
        for name, shape, dtype in meta:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self._broadcast(tensor)
            yield name, tensor


def weight_meta(weights: Iterable[tuple[str, torch.Tensor]]) -> WeightMeta:
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in weights]
