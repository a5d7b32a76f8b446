"""Ray placement: start or attach to a cluster, and run workers as Ray actors.

`ray.address` set: attach to that (persistent) cluster; otherwise start a local one for the run. Each
worker class runs in its own actor process holding its state for the whole stage; the driver (the RL
loop, inside the Prefect task) holds no model and calls worker methods with `WorkerGroup.call`.
"""

from __future__ import annotations

import logging
import os

from infra.config import Config, RayConfig
from infra.prefect_env import PROJECT_DIR

logger = logging.getLogger(__name__)

_PASSED_ENV = ("HF_HUB_OFFLINE", "HF_HOME", "VLLM_CPU_KVCACHE_SPACE", "WANDB_MODE", "CUDA_VISIBLE_DEVICES")


def worker_env(cfg: RayConfig) -> dict[str, str]:
    """Environment of every worker process. Ray would set OMP_NUM_THREADS=1 for a 1-CPU actor (and vLLM's
    CPU backend then pins torch to 1 thread); a colocated worker owns its share of the node's cores."""
    env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.num_devices_per_node))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    pythonpath = os.pathsep.join(p for p in (str(PROJECT_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env.update({"PYTHONPATH": pythonpath, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"})
    return env


def init_ray(cfg: RayConfig) -> bool:
    """Attach to `cfg.address` or start a local cluster; returns True when this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": worker_env(cfg)}
    if cfg.address:
        ray.init(address=cfg.address, runtime_env=runtime_env, namespace="rlpipe", log_to_driver=True)
        logger.info("attached to Ray cluster at %s", cfg.address)
    else:
        ray.init(num_cpus=cfg.num_cpus, include_dashboard=False, runtime_env=runtime_env, namespace="rlpipe",
                 log_to_driver=True, configure_logging=False)
        logger.info("started a local Ray cluster (%s CPUs)", ray.cluster_resources().get("CPU"))
    return True


class WorkerGroup:
    """Ray actors of one role; `call` runs a method on every worker and returns the results in rank order."""

    def __init__(self, cls, cfg: Config, model_dir: str, num_cpus: float = 1, num_gpus: float = 0):
        import ray

        world_size = cfg.ray.num_devices_per_node * cfg.ray.num_nodes
        remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(cls)
        self.name = cls.__name__
        self.handles = [remote.remote(cfg, model_dir, rank, world_size) for rank in range(world_size)]

    def call(self, method: str, *args, **kwargs) -> list:
        import ray

        return ray.get([getattr(h, method).remote(*args, **kwargs) for h in self.handles])

    def call_one(self, method: str, *args, **kwargs):
        return self.call(method, *args, **kwargs)[0]

    def kill(self) -> None:
        import ray

        for handle in self.handles:
            ray.kill(handle)
