"""Ray placement: start or attach to a cluster, and run a role's workers as N colocated Ray actors.

`ray.address` set: attach to that (persistent) cluster; otherwise start a local one for the run. The
workers of a run live in one Ray placement group of N = `ray.num_devices_per_node * ray.num_nodes`
bundles, one per device (a GPU, or one CPU slot on CPU machines), STRICT_PACK on one node and PACK across
nodes. The roles (actor+rollout+reference, critic) are colocated: each takes a share of every bundle, so
rank r of every role sits on device r. Each role's N actors form their own torch.distributed world (the
rendezvous address is rank 0's node and a free port there).

The driver (the RL loop, inside the Prefect task) holds no model. `call` runs a method on every rank with
the same arguments, `call_each` with per-rank arguments; `map_rows` splits a Batch across the ranks (see
stages/batch.py `rank_rows`) and puts the per-row results back in the batch's order. A role whose class names a
`sequence_parallel_size` P (the actor's Ulysses groups) is split over its N / P data-parallel ranks instead: the P
consecutive ranks of a group get the same rows, and the group's first rank's results come back.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import torch

from infra.config import Config
from infra.config_sections import RayConfig
from infra.console import WORKER_HOOK, WORKER_LOG_ENV
from infra.prefect_env import PROJECT_DIR
from stages.batch import Batch, gather_rows, rank_rows

logger = logging.getLogger(__name__)

_PASSED_ENV = ("HF_HUB_OFFLINE", "HF_HOME", "VLLM_CPU_KVCACHE_SPACE", "WANDB_MODE", "CUDA_VISIBLE_DEVICES",
               WORKER_LOG_ENV)
PLACEMENT_TIMEOUT_S = 120
# Threads of a GPU worker's torch. On a 64-core, 4-GPU host the GRPO step through the worker took 4.04 s at N = 1 with
# 64 threads (the cores' share) against 2.30 s with 1, and 16 threads a rank gave 0.90-0.92x the tokens/s of 1 at
# N = 4; 1 and 4 were within the runs' spread (bench/results/2026-11-27-gpu-packed-outputs.md). 4 keeps some
# parallelism for the batch's scatters.
GPU_WORKER_THREADS = 4


def worker_env(cfg: RayConfig) -> dict[str, str]:
    """Environment of every worker process. Ray would set OMP_NUM_THREADS=1 for a 1-CPU actor (and vLLM's
    CPU backend then pins torch to 1 thread); a colocated worker owns its share of the node's cores, unless the
    user set OMP_NUM_THREADS for the run (then every process of it uses that many). GPU workers take at most
    GPU_WORKER_THREADS: their host work is small tensor operations, which many threads slow down."""
    env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
    cores = max(1, (os.cpu_count() or 1) // (cfg.num_devices_per_node + cfg.rollout_devices_per_node))
    if torch.cuda.device_count():  # a GPU node: the workers get GPUs
        cores = min(cores, GPU_WORKER_THREADS)
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(cores)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    pythonpath = os.pathsep.join(p for p in (str(PROJECT_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env.update({"PYTHONPATH": pythonpath, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"})
    return env


class RayUnreachable(ValueError):
    """ray.init could not connect to `ray.address` (after Ray's own retries, ~14 minutes): a config error, not
    retried (tasks/stages.py `transient`), since a second attempt meets the same missing head and waits as long."""


def init_ray(cfg: RayConfig) -> bool:
    """Attach to `cfg.address` or start a local cluster; returns True when this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": worker_env(cfg)}
    if WORKER_LOG_ENV in runtime_env["env_vars"]:  # a quiet flow run: workers write to the stage's log file
        runtime_env["worker_process_setup_hook"] = WORKER_HOOK
    # configure_logging=False below removes Ray's own stderr handler from its logger: its driver logs (a
    # warning about token authentication, for one) go to our handlers then (run.log; the console per
    # tracking.console), not to Python's last-resort stderr.
    logging.getLogger("ray").propagate = True
    if cfg.address:
        from infra.cluster import attach_auth, start_advice

        attach_auth()  # a `ray start` cluster uses token authentication when a token exists
        try:
            ray.init(address=cfg.address, runtime_env=runtime_env, namespace="rlpipe", log_to_driver=True,
                     configure_logging=False)
        except ConnectionError as exc:  # an OSError, which `transient` retries; this one a retry meets again
            raise RayUnreachable(f"ray.address={cfg.address}: no Ray cluster answered there ({exc}). "
                                 f"{start_advice()}") from exc
        logger.info("attached to Ray cluster at %s", cfg.address)
    else:  # "local": a new cluster even when `ray start` runs on this machine (ray.init() would attach to it)
        ray.init(address="local", num_cpus=cfg.num_cpus, include_dashboard=False, runtime_env=runtime_env,
                 namespace="rlpipe", log_to_driver=True, configure_logging=False)
        logger.info("started a local Ray cluster (%s CPUs)", ray.cluster_resources().get("CPU"))
    return True


def _free_port() -> tuple[str, int]:
    """This node's IP and a TCP port nothing listens on (the rendezvous of a role's torch.distributed world)."""
    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        return ray.util.get_node_ip_address(), sock.getsockname()[1]


class Placement:
    """One bundle per device: {"CPU": 1} (+ {"GPU": 1} when the cluster has GPUs). The trainer's bundles
    (0 .. world_size-1) are shared by `num_roles` colocated roles; with `ray.rollout_devices_per_node`, the
    rollout workers' bundles follow them (from world_size on), one whole bundle each."""

    def __init__(self, cfg: RayConfig, num_roles: int):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        from infra.cluster import check_fits, live_nodes

        check_fits(cfg, live_nodes())  # too few devices: a clear error now, not after PLACEMENT_TIMEOUT_S
        self.world_size = cfg.num_trainers
        total = cfg.num_trainers + cfg.num_rollout_workers
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if gpus else {})}
        strategy = "STRICT_PACK" if cfg.num_nodes == 1 else "PACK"
        self.group = placement_group([dict(bundle) for _ in range(total)], strategy=strategy)
        if not self.group.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
            remove_placement_group(self.group)
            raise RuntimeError(
                f"Ray could not place {total} workers ({bundle} each, {strategy}) in "
                f"{PLACEMENT_TIMEOUT_S} s; the cluster has {ray.cluster_resources()}, of which "
                f"{ray.available_resources()} are free: other actors hold the rest (a persistent cluster's: `python -m "
                "infra.cluster status`)")
        self.share = {"num_cpus": 1.0 / num_roles, "num_gpus": (1.0 / num_roles) if gpus else 0}
        self.whole = {"num_cpus": 1.0, "num_gpus": 1.0 if gpus else 0}
        logger.info("placement group: %d bundles %s (%s), %d colocated roles%s", total, bundle, strategy, num_roles,
                    f", {cfg.num_rollout_workers} rollout workers" if cfg.num_rollout_workers else "")

    def strategy(self, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=rank)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def free_port_on(placement: Placement, bundle: int) -> tuple[str, int]:
    """The IP of the node holding `bundle` and a free port there (a rendezvous address)."""
    import ray

    return ray.get(ray.remote(num_cpus=0)(_free_port).options(scheduling_strategy=placement.strategy(bundle)).remote())


class WorkerGroup:
    """N Ray actors of one role, rank r on bundle `first_bundle` + r; results come back in rank order. By default
    the trainer's colocated roles (N = placement.world_size, a share of each bundle); `rollout=True`: the rollout
    workers (N = ray.rollout_devices_per_node * ray.num_nodes, whole bundles)."""

    def __init__(self, cls, cfg: Config, model_dir: str, placement: Placement, rollout: bool = False):
        import ray

        self.name = cls.__name__
        self.world_size = cfg.ray.num_rollout_workers if rollout else placement.world_size
        self.sequence_parallel_size = cls.sequence_parallel_size(cfg) if hasattr(cls, "sequence_parallel_size") else 1
        first = placement.world_size if rollout else 0
        addr, port = free_port_on(placement, first)
        remote = ray.remote(**(placement.whole if rollout else placement.share))(cls)
        self.handles = [
            remote.options(scheduling_strategy=placement.strategy(first + rank)).remote(
                cfg, model_dir, rank, self.world_size, addr, port)
            for rank in range(self.world_size)
        ]
        self.call("__ray_ready__")  # construction errors surface here, naming the worker

    def call(self, method: str, *args, **kwargs) -> list:
        """`method(*args)` on every rank (collectives inside need all of them)."""
        return self.get_all([getattr(h, method).remote(*args, **kwargs) for h in self.handles])

    def call_one(self, method: str, *args, **kwargs):
        """Rank 0's result of a call on every rank (workers reduce results across ranks themselves)."""
        return self.call(method, *args, **kwargs)[0]

    def call_each(self, method: str, per_rank_args: list[tuple]) -> list:
        return self.get_all([getattr(h, method).remote(*args) for h, args in zip(self.handles, per_rank_args)])

    def map_rows(self, method: str, batch: Batch, mini_rows: int, *args):
        """Data-parallel rank d computes on its rows (`rank_rows`); per-row tensor results (or tuples of them) are
        gathered back into the batch's row order."""
        shards = rank_rows(len(batch), self.world_size // self.sequence_parallel_size, mini_rows)
        results = self._split(method, batch, shards, args)[:: self.sequence_parallel_size]  # one per group
        if isinstance(results[0], tuple):
            return tuple(gather_rows([r[i] for r in results], shards) for i in range(len(results[0])))
        return gather_rows(results, shards)

    def split_call(self, method: str, batch: Batch, mini_rows: int, *args):
        """Data-parallel rank d trains on its rows of each mini-batch; rank 0's (globally reduced) metrics come
        back."""
        shards = rank_rows(len(batch), self.world_size // self.sequence_parallel_size, mini_rows)
        return self._split(method, batch, shards, args)[0]

    def _split(self, method: str, batch: Batch, shards: list[list[int]], args: tuple) -> list:
        """`method(rows, *args)` on every rank, the ranks of a sequence-parallel group with their group's rows.
        Only the tensors travel: the workers compute on them, and the meta (texts, turns) stays on the driver."""
        tensors_only = Batch(batch.tensors)
        parts = [tensors_only.select(rows) for rows in shards]
        return self.call_each(method, [(parts[rank // self.sequence_parallel_size], *args)
                                       for rank in range(self.world_size)])

    def call_within(self, timeout_s: float, method: str, *args) -> list:
        """`call`, or TimeoutError when the ranks have not all answered in `timeout_s` (a stalled worker)."""
        return self.get_all([getattr(h, method).remote(*args) for h in self.handles], timeout_s)

    @staticmethod
    def get_all(refs: list, timeout_s: float | None = None) -> list:
        """Results in rank order; a failed rank raises at once, not after ranks blocked in a collective with it.
        `timeout_s`: TimeoutError when they are not all done by then (the calls go on in their workers)."""
        import ray

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                raise TimeoutError(f"{len(pending)} of {len(refs)} worker calls not done after {timeout_s:g} s")
            ray.get(ready)
        return ray.get(refs)

    def kill(self) -> None:
        import ray

        for handle in self.handles:
            ray.kill(handle)
