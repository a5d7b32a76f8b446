"""AdamW and the learning-rate schedule shared by SFT and RL: linear warmup, then constant/cosine/linear."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from infra.trainer_config import OptimConfig


def build_optimizer(params, cfg: OptimConfig, offload_state: bool = False) -> torch.optim.Optimizer:
    """AdamW; `offload_state`: its state waits in host memory between steps (`OffloadedAdamW`)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters: check model.lora.target_modules")
    kind = OffloadedAdamW if offload_state else torch.optim.AdamW
    return kind(trainable, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=1e-8,
                fused=fused_adamw(trainable))


def fused_adamw(trainable: list) -> bool | None:
    """True (one fused kernel a step) on GPUs, and for FSDP2 shards offloaded to host memory from one (sft.offload,
    rl.actor.param_offload): there torch's default, a loop of a dozen passes a tensor, took 4.5-5.5 s of an 11 s
    step at 3B; fused took 3.3-3.5x less on FSDP2 shards at 1 and 2 threads (bench/results/2026-11-24-cpu-adamw.md),
    and 6.5-7.9x less on 16-core H100 hosts, making that step 6.9-7.3 s
    (bench/results/2026-11-25-gpu-sft-offload-adamw.md). None (torch's default) for runs on CPU only, as before."""
    if all(p.is_cuda for p in trainable):
        return True
    offloaded = torch.cuda.is_available() and all(isinstance(p, DTensor) and p.to_local().device.type == "cpu"
                                                  for p in trainable)
    return True if offloaded else None


class OffloadedAdamW(torch.optim.AdamW):
    """AdamW whose moments (2x the trained parameters in fp32) live in host memory between steps (verl's
    `optimizer_offload`): each step copies them to the parameters' device, steps, copies them back and frees
    the device storage, so generation and forward/backward run without them.

    The state tensors keep their identity (only their storage is emptied and refilled), so FSDP2's DTensor
    state and checkpointing work as with AdamW; `state_dict` brings the state back first (it stays on the
    device until the next step ends). Host buffers are pinned where CUDA is available.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # (id(param), state key) -> host copy
        self._offloaded = False

    def step(self, closure=None):
        self._reload()
        loss = super().step(closure)
        self.offload()
        return loss

    def state_dict(self):
        self._reload()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._reload()
        super().load_state_dict(state_dict)  # new state tensors on the parameters' devices
        self._host.clear()

    def _moments(self):
        """(key, device tensor) for every state tensor worth moving (the scalar step counters stay)."""
        for param, state in self.state.items():
            for name, value in state.items():
                local = value.to_local() if hasattr(value, "to_local") else value
                if torch.is_tensor(local) and local.numel() > 1:
                    yield (id(param), name), local

    def offload(self) -> None:
        """Moments to host memory, their device storage emptied (nothing to do when they are there already)."""
        if self._offloaded:
            return
        pin = torch.cuda.is_available()
        moments = list(self._moments())
        for key, local in moments:
            host = self._host.get(key)
            if host is None:
                host = self._host[key] = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
            host.copy_(local, non_blocking=True)
        if pin:
            torch.cuda.synchronize()  # the copies read the storage freed next
        for _, local in moments:
            local.untyped_storage().resize_(0)
        self._offloaded = True

    def _reload(self) -> None:
        if not self._offloaded:
            return
        for key, local in self._moments():
            host = self._host[key]
            local.untyped_storage().resize_(host.numel() * host.element_size())
            local.copy_(host, non_blocking=True)
        self._offloaded = False


def lr_multiplier(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Share of the peak lr at optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_scheduler == "constant":
        return 1.0
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.lr_scheduler == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))


def clipped_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> tuple:
    """Clip the gradients to `max_norm`, step unless their norm is not finite, zero them. Returns the norm and
    1.0 if the step was skipped (else 0.0), both device scalars: an optimizer that takes `found_inf` (fused
    AdamW, torch's GradScaler protocol) skips on the device, so the host never waits for it here; any other
    optimizer reads the norm first."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    found_inf = (~torch.isfinite(norm)).float()
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf, optimizer.grad_scale = found_inf, None
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
    elif math.isfinite(float(norm)):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, found_inf
