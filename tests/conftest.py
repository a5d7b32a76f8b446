"""Shared fixtures: a real local S3 server (moto's standalone server on 127.0.0.1) and an artifact store on
each backend, so that the same store tests run against a local folder and against S3."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import pytest

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
