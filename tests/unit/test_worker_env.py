"""worker_env's thread count: a share of the node's cores on CPU, at most GPU_WORKER_THREADS on a GPU node, and
the user's OMP_NUM_THREADS over both."""

import pytest
import torch

from infra.config_sections import RayConfig
from stages.workers import group
from stages.workers.group import GPU_WORKER_THREADS, worker_env


@pytest.mark.parametrize("gpus, devices, user, expected", [
    (0, 4, None, "16"),  # CPU: 64 cores over 4 workers
    (4, 4, None, str(GPU_WORKER_THREADS)),  # GPU: capped (16 threads a rank slowed the step down)
    (1, 1, None, str(GPU_WORKER_THREADS)),  # one GPU on 64 cores: not 64 threads
    (4, 32, None, "2"),  # fewer cores than the cap per worker: the share
    (4, 4, "7", "7"),  # the user's setting wins
])
def test_worker_threads(monkeypatch, gpus, devices, user, expected):
    monkeypatch.setattr(group.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if user is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user)
    assert worker_env(RayConfig(num_devices_per_node=devices))["OMP_NUM_THREADS"] == expected
