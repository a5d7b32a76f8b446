"""Shared fixtures: a real local S3 server (moto's standalone server on 127.0.0.1) and an artifact store on
each backend, so that the same store tests run against a local folder and against S3."""

from __future__ import annotations

import os
import tempfile

# Before anything imports prefect, vllm or wandb: keep their state out of the user's home and offline.
_SESSION_DIR = tempfile.mkdtemp(prefix="rlpipe-tests-")
os.environ["PREFECT_HOME"] = os.path.join(_SESSION_DIR, "prefect")
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = os.path.join(_SESSION_DIR, "prefect", "results")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from infra import prefect_env  # noqa: E402  (the rest of Prefect's defaults, before a test module imports prefect)

prefect_env.configure()

import socket
import uuid
from collections.abc import Iterator

import pytest

from infra.config import Config, load_config
from infra.store import ArtifactStore


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (closed again before return)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalS3:
    """moto's ThreadedMotoServer on 127.0.0.1 with stop()/start() for outage tests.

    moto keeps its buckets in process memory, so they survive a stop()/start() in the same process.
    """

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.running = False

    def start(self) -> None:
        self._server.start()
        self.running = True

    def stop(self) -> None:
        """Stop serving and close the listening socket, so new connections are refused (a real outage)."""
        self._server.stop()
        self._server._server.server_close()  # ThreadedMotoServer.stop() leaves the socket listening
        self.running = False

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1")

    def create_bucket(self, name: str | None = None) -> str:
        """Create a fresh bucket with boto3 (s3fs.mkdir fails on moto with InvalidLocationConstraint)."""
        name = name or f"test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LocalS3]:
    """A running local S3 server with fake credentials in the environment for the whole session."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1"}.items():
            mp.setenv(key, value)
        for key in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
            mp.delenv(key, raising=False)
        mp.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")  # no user profile leaks into tests
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
        server = LocalS3()
        server.start()
        yield server
        if server.running:
            server.stop()


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, tmp_path) -> ArtifactStore:
    """A fresh, empty ArtifactStore: a tmp folder, or a fresh bucket + prefix on the local S3 server."""
    if request.param == "local":
        return ArtifactStore(str(tmp_path / "store"), cache_dir=tmp_path / "cache")
    server = request.getfixturevalue("s3_server")
    bucket = server.create_bucket()
    return ArtifactStore(f"s3://{bucket}/store", endpoint_url=server.endpoint_url, cache_dir=tmp_path / "cache")


# --------------------------------------------------------------------------------------------------
# A tiny synthetic dataset and a tiny model built from it, shared by the tests of one session.

TINY_OVERRIDES = [
    "data.synthetic.num_train=256", "data.synthetic.num_validation=32", "data.synthetic.num_terms=3",
    "data.synthetic.max_operand=9", "model.tiny.hidden_size=128", "model.tiny.intermediate_size=256",
    "sft.epochs=1", "sft.train_batch_size=32", "sft.micro_batch_size=16", "evaluate.batch_size=32",
]


@pytest.fixture(scope="session")
def tiny_config() -> Config:
    return load_config(None, TINY_OVERRIDES)


@pytest.fixture(scope="session")
def tiny_data_dir(tiny_config, tmp_path_factory):
    from stages.data_prep import run_data_prep

    out = tmp_path_factory.mktemp("tiny-data")
    run_data_prep(tiny_config.data, tiny_config.run.seed, out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_config, tiny_data_dir, tmp_path_factory):
    from stages.data_prep import corpus_texts
    from stages.model.tiny import build_tiny_model

    return build_tiny_model(tiny_config.model.tiny, corpus_texts(tiny_data_dir), 0,
                            tmp_path_factory.mktemp("tiny-model"))



@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance per test module (2 CPUs); modules opt in with usefixtures("ray_cluster")."""
    import ray

    from infra.config_sections import RayConfig
    from stages.workers.group import init_ray

    init_ray(RayConfig(num_cpus=2))
    yield
    ray.shutdown()

def pytest_sessionfinish(session, exitstatus):
    """Stop Prefect's temporary server while pytest's output capture is still open (its atexit hook
    would otherwise log to a closed stream)."""
    import sys

    if "prefect.server.api.server" in sys.modules:
        from prefect.server.api.server import SubprocessASGIServer

        for server in list(SubprocessASGIServer._instances.values()):
            server.stop()
