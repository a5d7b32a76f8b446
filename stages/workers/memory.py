"""Peak memory per phase of a worker's step, for the step's metrics (verl's perf/max_memory_* names, by phase).

`MemoryPeaks.phase(name)` brackets one phase: on CUDA it resets the allocator's peak statistics on entry and keeps
the peak allocated bytes on exit (the largest over repeated calls). `metrics()` is a collective (every rank calls it,
in the same order): each value is the maximum over ranks, and the peaks start again. On CPU the phases record
nothing and `perf/cpu_memory_used_gb` is the process's resident memory (the largest over ranks).
`perf/compiled_graphs` counts the graphs torch.compile has made in the process so far: a step that raises it
recompiled (a new shape), which shows as a slow phase. On CUDA `perf/num_alloc_retries` counts the caching
allocator's retries so far (an allocation that failed, freed the cache and synchronized before trying again): a
step that raises it paid for memory pressure.
"""

from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist

from stages.model.fsdp import all_reduce

GB = 2**30


class MemoryPeaks:
    """scope: a part of the metric names after `perf` ("/rollout": `perf/rollout/max_memory_allocated_gb/gen`), for
    workers whose figures sit beside the trainer's."""

    def __init__(self, device: torch.device, scope: str = ""):
        self.cuda = device.type == "cuda"
        self.scope = scope
        self.peaks: dict[str, float] = {}
        self.open: list[str] = []  # the phases running now, outermost first (sync runs the check's gen inside it)
        self.reserved = 0.0  # the largest reserved bytes (GB) since the last metrics, across the counters' resets

    @contextmanager
    def phase(self, name: str):
        """Each phase's peak, a phase that runs inside another's counting in both: the device's peak counters
        are reset as a phase starts, so what the open phases reached is folded into them first."""
        if self.cuda:
            self._fold()
            torch.cuda.reset_peak_memory_stats()
        self.open.append(name)
        try:
            yield
        finally:
            if self.cuda:
                self._fold()
            self.open.pop()

    def _fold(self) -> None:
        allocated = torch.cuda.max_memory_allocated() / GB
        for name in self.open:
            self.peaks[name] = max(self.peaks.get(name, 0.0), allocated)
        self.reserved = max(self.reserved, torch.cuda.max_memory_reserved() / GB)

    def metrics(self) -> dict[str, float]:
        perf = f"perf{self.scope}"
        values = {f"{perf}/max_memory_allocated_gb/{k}": v for k, v in sorted(self.peaks.items())}
        if self.cuda:
            values[f"{perf}/max_memory_allocated_gb"] = max(self.peaks.values(), default=0.0)
            values[f"{perf}/max_memory_reserved_gb"] = max(self.reserved, torch.cuda.max_memory_reserved() / GB)
            self.reserved = 0.0
            values[f"{perf}/num_alloc_retries"] = float(torch.cuda.memory_stats().get("num_alloc_retries", 0))
        values[f"{perf}/cpu_memory_used_gb"] = _resident_bytes() / GB
        values[f"{perf}/compiled_graphs"] = float(compiled_graphs())
        self.peaks.clear()
        reduced = all_reduce(torch.tensor(list(values.values()), dtype=torch.float64), dist.ReduceOp.MAX)
        return dict(zip(values, reduced.tolist()))  # ranks ran the same phases: same keys


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process (0 before anything is compiled; dynamo is not imported here
    for it)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measured(phase):
    """Method decorator: the call runs inside `self.memory.phase(...)`; `phase` is a name, or a function of the call's
    arguments giving one."""

    def wrap(method):
        @functools.wraps(method)
        def inner(self, *args, **kwargs):
            name = phase(*args, **kwargs) if callable(phase) else phase
            with self.memory.phase(name):
                return method(self, *args, **kwargs)

        return inner

    return wrap
