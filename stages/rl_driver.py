"""The RL driver's own costs: its torch threads (`driver_threads`) and its per-phase step timings (`StepTimer`)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

DRIVER_THREADS = 8


@contextmanager
def driver_threads(limit: int = DRIVER_THREADS):
    """The driver's torch ops on at most `limit` threads. The driver only builds, balances and slices batches (the
    workers compute, in their own processes); with one thread per core of a 64-core GPU host its small ops took
    3-5x as long as with 1-16 threads (bench/driver_cpu.py: 0.63-0.90 s a step for 4 ranks' 1,024 samples against
    0.18-0.20 s), time that no GPU overlaps."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(before, limit))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class StepTimer:
    def __init__(self):
        self.metrics: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.metrics[f"timing_s/{name}"] = self.metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start
