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
