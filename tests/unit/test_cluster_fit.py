"""A run that asks for more devices than the Ray cluster has fails at once, naming the keys, the values and what the
cluster has (infra.cluster.check_fits), instead of waiting for the placement group's timeout; it is a config error,
which Prefect does not retry, and the command line refuses it before the flow starts for a local cluster."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest

from flows.post_train import main, preflight
from infra.cluster import ClusterTooSmall, check_fits
from infra.config import ConfigError, load_config
from infra.config_sections import RayConfig
from tasks.stages import REPEATABLE, transient


def cpu(n: float) -> dict[str, float]:
    return {"CPU": float(n), "memory": 1e9}


def gpu(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": float(cpus), "GPU": float(gpus)}


@pytest.mark.parametrize(("ray", "nodes"), [
    ({"num_devices_per_node": 2}, [cpu(2)]),
    ({"num_devices_per_node": 1, "rollout_devices_per_node": 1}, [cpu(2)]),
    ({"num_devices_per_node": 8}, [gpu(64, 8)]),
    ({"num_devices_per_node": 4, "num_nodes": 2}, [gpu(16, 4), gpu(16, 4)]),  # PACK: the cluster's total
    ({"num_devices_per_node": 4, "num_nodes": 2}, [gpu(16, 8)]),  # PACK packs onto one node when it fits
])
def test_what_fits_passes(ray, nodes):
    check_fits(RayConfig(**ray), nodes)


def test_more_cpu_slots_than_the_local_cluster_has():
    with pytest.raises(ClusterTooSmall) as info:
        check_fits(RayConfig(num_devices_per_node=4, num_cpus=2), [cpu(2)])
    assert str(info.value) == (
        "ray.num_devices_per_node=4 asks for 4 workers, each 1 CPU (the cluster has no GPU), on one node "
        "(ray.num_nodes=1); this machine's local Ray cluster has 2 CPUs and no GPU (ray.num_cpus=2). Set "
        "ray.num_devices_per_node=2 or less, or raise ray.num_cpus (the local cluster's CPU slots; more than the cores "
        "is allowed)")


def test_more_gpus_than_one_node_of_a_remote_cluster_has():
    # STRICT_PACK (num_nodes=1): 8 workers on one node, and no node has 8 GPUs although the cluster does
    with pytest.raises(ClusterTooSmall) as info:
        check_fits(RayConfig(num_devices_per_node=8, address="10.0.0.1:6379"), [gpu(32, 4), gpu(32, 4)])
    assert str(info.value) == (
        "ray.num_devices_per_node=8 asks for 8 workers, each 1 GPU and 1 CPU, on one node (ray.num_nodes=1); the Ray "
        "cluster at ray.address=10.0.0.1:6379 has 2 nodes, 64 CPUs and 8 GPUs in all, the largest 32 CPUs and 4 GPUs. "
        "Set ray.num_devices_per_node=4 or less, or add nodes to the cluster")


def test_rollout_devices_count_and_the_fix_says_which_key():
    with pytest.raises(ClusterTooSmall, match=r"^\(ray.num_devices_per_node=2 \+ ray.rollout_devices_per_node=2\) x "
                                              r"ray.num_nodes=2 asks for 8 workers.*Set ray.num_devices_per_node=1 "):
        check_fits(RayConfig(num_devices_per_node=2, rollout_devices_per_node=2, num_nodes=2, address="auto"),
                   [gpu(8, 3), gpu(8, 3)])
    with pytest.raises(ClusterTooSmall, match=r"Lower ray.rollout_devices_per_node=4"):
        check_fits(RayConfig(num_devices_per_node=1, rollout_devices_per_node=4, address="auto"), [gpu(8, 4)])


def test_cpus_bound_a_gpu_node_too():
    with pytest.raises(ClusterTooSmall, match="each 1 GPU and 1 CPU.*has 2 CPUs and 8 GPUs"):
        check_fits(RayConfig(num_devices_per_node=4, num_cpus=2), [gpu(2, 8)])


def test_it_is_not_retried():
    assert issubclass(ClusterTooSmall, REPEATABLE)


def test_the_command_line_refuses_it_before_the_flow_starts(tmp_path, capsys):
    args = [f"storage.root={tmp_path / 'store'}", f"run.output_dir={tmp_path / 'out'}", "rl.enabled=true",
            "ray.num_cpus=2", "ray.num_devices_per_node=4"]
    assert main(args) == 2
    assert capsys.readouterr().err.startswith("error: ray.num_devices_per_node=4 asks for 4 workers")
    assert not (tmp_path / "out").exists()


def test_preflight_leaves_a_run_without_placement_and_a_remote_cluster_alone(tmp_path):
    store = f"storage.root={tmp_path / 'store'}"
    preflight(load_config(None, [store, "sft.enabled=false", "ray.num_cpus=1", "ray.num_devices_per_node=4"]))
    preflight(load_config(None, [store, "rl.enabled=true", "sft.enabled=false", "ray.address=auto",
                                  "ray.num_devices_per_node=32"]))
    with pytest.raises(ConfigError, match="ray.num_devices_per_node=4 asks"):
        preflight(load_config(None, [store, "ray.num_cpus=1", "ray.num_devices_per_node=4"]))  # SFT on 4 ranks


def unused_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_ray_address_where_nothing_listens_is_refused_before_the_flow_starts(tmp_path, capsys):
    """Ray's driver retried the connection for ~14 minutes in RL, after data prep and SFT had run, twice."""
    address, store = f"127.0.0.1:{unused_port()}", f"storage.root={tmp_path / 'store'}"
    with pytest.raises(ConfigError, match=r"^ray\.address=ray://127\.0\.0\.1:\d+: no Ray cluster listens there"):
        preflight(load_config(None, [store, f"ray.address=ray://{address}"]))
    with pytest.raises(ConfigError):  # first, so that a preflight that lets it pass does not start the flow below
        preflight(load_config(None, [store, f"ray.address={address}"]))
    start = time.monotonic()
    assert main([store, f"run.output_dir={tmp_path / 'out'}", f"ray.address={address}"]) == 2
    assert time.monotonic() - start < 30
    err = capsys.readouterr().err
    assert err.startswith(f"error: ray.address={address}: no Ray cluster listens there (Connection refused). "), err
    assert "`make ray-up ARGS=\"--port" in err and "ray.address=null" in err
    assert not (tmp_path / "out").exists()


def test_a_ray_address_where_something_listens_passes_preflight(tmp_path):
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen()
        preflight(load_config(None, [f"storage.root={tmp_path / 'store'}",
                                      f"ray.address=127.0.0.1:{head.getsockname()[1]}"]))


def retried(error: BaseException) -> bool:
    return transient(None, None, SimpleNamespace(result=lambda raise_on_failure=False: error))


def test_ray_init_failing_to_connect_is_a_config_error_that_is_not_retried(monkeypatch):
    """ray.init's ConnectionError (an OSError, like a stalled store's, which stays retried) was retried: another
    ~14 minutes against the same missing head."""
    import ray

    from infra.store_base import StoreError
    from stages.workers.group import init_ray

    def refuse(address, **_):
        raise ConnectionError(f"Failed to connect to Ray cluster at {address}")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr("infra.cluster.attach_auth", lambda: None)
    with pytest.raises(Exception) as info:
        init_ray(RayConfig(address="127.0.0.1:1"))
    assert not retried(info.value)
    assert type(info.value).__name__ == "RayUnreachable" and isinstance(info.value.__cause__, ConnectionError)
    assert str(info.value).startswith("ray.address=127.0.0.1:1: no Ray cluster answered there (Failed to connect to "
                                      "Ray cluster at 127.0.0.1:1). Start its head on that host first (`make ray-up`")
    assert retried(StoreError("s3://bucket: no answer within 18 s"))
    assert retried(ConnectionError("the store's endpoint dropped the connection"))


@pytest.mark.slow
def test_placement_on_a_real_cluster_fails_in_seconds():
    """A real local Ray cluster of 1 CPU slot: Placement refuses 3 workers at once (it waited 120 s, twice)."""
    import ray

    from stages.workers.group import Placement

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        start = time.monotonic()
        with pytest.raises(ClusterTooSmall, match="this machine's local Ray cluster has 1 CPUs and no GPU"):
            Placement(RayConfig(num_devices_per_node=3), num_roles=1)
        assert time.monotonic() - start < 10
    finally:
        ray.shutdown()


def test_a_deployments_run_checks_its_config_before_anything_runs(tmp_path):
    """Only the command line ran preflight: a deployment's run with a missing model folder failed after data prep."""
    from flows.post_train import post_train

    with pytest.raises(ConfigError, match="model.path=./no-such-model: no such file or folder"):
        post_train.fn(None, [f"storage.root={tmp_path / 'store'}", f"run.output_dir={tmp_path / 'out'}",
                             "model.path=./no-such-model"])
    assert not (tmp_path / "out").exists()


def test_an_evaluation_engine_that_is_not_installed_is_refused_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr("stages.evaluate.find_spec", lambda name: None)  # vLLM absent
    with pytest.raises(ConfigError, match="evaluate.engine=vllm but vLLM is not installed"):
        preflight(load_config(None, [f"storage.root={tmp_path / 'store'}", "evaluate.engine=vllm"]))
