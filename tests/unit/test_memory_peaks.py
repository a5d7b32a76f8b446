"""Peak memory per phase (stages/workers/memory.py): phases named by the decorator, metrics on CPU."""

from __future__ import annotations

import pytest
import torch

from stages.workers.memory import MemoryPeaks, measured


class Worker:
    def __init__(self):
        self.memory = MemoryPeaks(torch.device("cpu"))
        self.seen = []

    @measured(lambda batch, role="actor": "old_log_prob" if role == "actor" else "ref")
    def logprobs(self, batch, role="actor"):
        self.seen.append(role)
        return len(batch)

    @measured("update_actor")
    def update(self):
        raise ValueError("bad batch")


def test_the_decorator_names_the_phase_from_the_arguments_and_keeps_results_and_errors(monkeypatch):
    worker, opened = Worker(), []
    original = worker.memory.phase
    monkeypatch.setattr(worker.memory, "phase", lambda name: opened.append(name) or original(name))
    assert worker.logprobs([1, 2]) == 2 and worker.logprobs([1], role="ref") == 1
    try:
        worker.update()
    except ValueError as exc:
        assert str(exc) == "bad batch"
    assert opened == ["old_log_prob", "ref", "update_actor"] and worker.seen == ["actor", "ref"]


def test_cpu_metrics_give_the_resident_memory_and_no_device_peaks():
    memory = MemoryPeaks(torch.device("cpu"))
    with memory.phase("gen"):
        block = torch.ones(2**20)  # noqa: F841 - 4 MiB resident while measured
    metrics = memory.metrics()
    assert list(metrics) == ["perf/cpu_memory_used_gb", "perf/compiled_graphs"]
    assert 0.01 < metrics["perf/cpu_memory_used_gb"] < 1024


def test_a_scope_names_another_worker_s_figures():
    memory = MemoryPeaks(torch.device("cpu"), scope="/rollout")
    with memory.phase("gen"):
        pass
    assert list(memory.metrics()) == ["perf/rollout/cpu_memory_used_gb", "perf/rollout/compiled_graphs"]


def test_a_recompilation_raises_the_compiled_graphs_count():
    memory = MemoryPeaks(torch.device("cpu"))
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    double(torch.ones(3))
    before = memory.metrics()["perf/compiled_graphs"]
    double(torch.ones(3))  # the same shape: no new graph
    assert memory.metrics()["perf/compiled_graphs"] == before >= 1
    double(torch.ones(5))  # a new shape, static: a new graph
    assert memory.metrics()["perf/compiled_graphs"] == before + 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_metrics_give_the_phase_peaks_and_the_allocator_retries():
    memory = MemoryPeaks(torch.device("cuda"))
    with memory.phase("gen"):
        block = torch.ones(2**28, device="cuda")  # noqa: F841 - 1 GiB at the peak
    metrics = memory.metrics()
    assert metrics["perf/max_memory_allocated_gb"] >= metrics["perf/max_memory_allocated_gb/gen"] >= 1.0
    assert metrics["perf/num_alloc_retries"] == torch.cuda.memory_stats().get("num_alloc_retries", 0)


class FakeAllocator:
    """torch.cuda's peak counters over a hand-driven allocation: `use(gb)` allocates (reserving as it goes, never
    releasing), `free(gb)` frees."""

    def __init__(self, monkeypatch):
        self.now = self.peak = self.reserved = self.reserved_peak = 0.0
        gb = 1024**3
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: self.peak * gb)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: self.reserved_peak * gb)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)

    def reset(self):
        self.peak, self.reserved_peak = self.now, self.reserved

    def use(self, gb: float):
        self.now += gb
        self.peak, self.reserved = max(self.peak, self.now), max(self.reserved, self.now)
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, gb: float, release: bool = False):
        self.now -= gb
        if release:  # empty_cache
            self.reserved = self.now


def test_a_phase_inside_another_counts_in_both_and_reserved_is_the_steps_peak(monkeypatch):
    """The weight sync runs the engine check's generation (a phase) inside it: entering it reset the counters, so
    sync reported only the check's 1 GiB, not its own 4; reserved reported the peak since the last phase began."""
    memory, device = MemoryPeaks(torch.device("cuda")), FakeAllocator(monkeypatch)
    with memory.phase("update_actor"):
        device.use(8)
        device.free(8, release=True)  # empty_cache after the update
    with memory.phase("sync"):
        device.use(4)
        device.free(4)
        with memory.phase("gen"):
            device.use(1)
            device.free(1)
    assert memory.peaks == {"update_actor": 8.0, "sync": 4.0, "gen": 1.0}
    assert memory.reserved == 8.0
