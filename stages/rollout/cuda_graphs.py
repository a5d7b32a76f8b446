"""The `cuda` engine's decode steps as CUDA graphs (cuda_engine.py): one graph per (batch bucket, cache length,
sampling mode), captured on first use into one shared memory pool and replayed afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from stages.rollout.sampling import SamplingMode

Step = Callable[[int, int, SamplingMode], None]  # (bucket, kv_len, mode): one decode step, eager


class DecodeGraphs:
    """step: the engine's eager decode step; counters: the device tensors a step advances (slot counters, the
    sampler's seed), put back after the warm-up and the capture so that capturing generates nothing."""

    def __init__(self, step: Step, counters: tuple[torch.Tensor, ...], device: torch.device):
        self.step, self.counters, self.device = step, counters, device
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None

    def get(self, bucket: int, kv_len: int, mode: SamplingMode) -> tuple[torch.cuda.CUDAGraph, float]:
        """The graph of this step; -> (graph, seconds spent capturing it now: 0.0 when it was captured before)."""
        key = (bucket, kv_len, mode)
        if key in self._graphs:
            return self._graphs[key], 0.0
        start = time.perf_counter()
        self._graphs[key] = self._capture(bucket, kv_len, mode)
        return self._graphs[key], time.perf_counter() - start

    def clear(self) -> None:
        """Drop every graph and the pool (the graphs held it: capturing into its stale handle trips the allocator)."""
        self._graphs.clear()
        self._pool = None

    def _capture(self, bucket: int, kv_len: int, mode: SamplingMode) -> torch.cuda.CUDAGraph:
        """Warm up (compilation, library workspaces) and capture one decode step; state and RNG restored.

        The warm-up steps write the same K/V the real step will write (same tokens, same positions) and
        output cells that later steps overwrite; the slot counters and the RNG are put back.
        """
        saved = [t.clone() for t in self.counters]
        rng = torch.cuda.get_rng_state(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(bucket, kv_len, mode)
                self._restore(saved)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.step(bucket, kv_len, mode)
        self._restore(saved)
        torch.cuda.set_rng_state(rng, self.device)
        return graph

    def _restore(self, saved: list[torch.Tensor]) -> None:
        for t, v in zip(self.counters, saved):
            t.copy_(v)
