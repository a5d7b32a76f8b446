"""The store, SQL and the flow against an S3 endpoint that fails the way networks do: tests/faults.py's proxy in
front of the local S3 server. A stalled endpoint (connections accepted, never answered) makes every operation
fail with one clear error within the bound of ``infra.s3.stall_bound_s``, instead of hanging; the store stays
intact and works again once the endpoint answers. A flaky one (every 3rd connection dropped) is absorbed by
the retries. These tests assert that a hang ends within its bound (behaviour), measured, never how fast
anything runs."""

from __future__ import annotations

import re
import time
from pathlib import Path

import duckdb
import pytest

from infra import sql
from infra.config_sections import StorageConfig
from infra.s3 import PART_BYTES, stall_bound_s
from infra.store import ArtifactStore, StoreError
from infra.trajectories import RunTables
from tests.conftest import TINY_OVERRIDES
from tests.faults import FaultProxy

pytestmark = pytest.mark.s3

MiB = 2**20
SLACK_S = 5  # scheduling on a busy machine; the bounds below are 3 to 10 s
LIMITS = {"timeout_s": 1, "max_attempts": 2, "min_upload_mib_s": 4}  # small, so that each stall takes seconds
TIMED_OUT = "Fix: the endpoint did not answer in"


@pytest.fixture
def proxy(s3_server):
    proxy = FaultProxy(s3_server.port)
    yield proxy
    proxy.close()


def open_store(proxy: FaultProxy, bucket: str, cache: Path, **limits) -> ArtifactStore:
    cfg = StorageConfig(root=f"s3://{bucket}/p", endpoint_url=proxy.endpoint_url, **limits)
    return ArtifactStore(cfg.root, cfg.endpoint_url, cache, limits=cfg)


@pytest.fixture
def s3_store(proxy, s3_server, tmp_path) -> ArtifactStore:
    """A store through the proxy with one table file t/x and one version of model/m."""
    store = open_store(proxy, s3_server.create_bucket(), tmp_path / "cache", **LIMITS)
    store.write_bytes("t/x", b"x")
    store.put_dir("model", "m", make_dir(tmp_path / "m", {"w.bin": b"w" * 1000}))
    return store


def make_dir(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def timed(call) -> tuple[BaseException, float]:
    """The exception call raises and the seconds until it did."""
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        call()
    return info.value, time.monotonic() - start


# operation -> (call(store, tmp_path), the start of its error message, bytes it sends in one request)
OPERATIONS = {
    "check": (lambda s, tmp: s.check(), "reaching the bucket", 0),
    "read_bytes": (lambda s, tmp: s.read_bytes("t/x"), "reading t/x", 0),
    "write_bytes": (lambda s, tmp: s.write_bytes("t/y", b"y" * MiB), "writing t/y", MiB),
    "glob": (lambda s, tmp: s.glob("t/*"), "glob t/*", 0),
    "get_dir": (lambda s, tmp: s.get_dir(s.latest("model", "m"), tmp / "copy"), "listing model/m", 0),
    "put_dir": (lambda s, tmp: s.put_dir("model", "n", make_dir(tmp / "n", {"a": b"a" * MiB})), "reading model/n@",
                0),  # its first request looks for the version
}


@pytest.mark.parametrize("operation", OPERATIONS)
def test_a_stalled_endpoint_fails_each_operation_within_its_bound(operation, proxy, s3_store, tmp_path):
    call, action, body_bytes = OPERATIONS[operation]
    proxy.stall()
    error, waited = timed(lambda: call(s3_store, tmp_path))
    bound = stall_bound_s(s3_store.limits, body_bytes)  # 2 attempts of 1 s (+ 0.25 s per MiB sent) + 1 s backoff
    assert isinstance(error, StoreError) and s3_store.limits.timeout_s <= waited < bound + SLACK_S, (waited, error)
    message = str(error)
    assert message.startswith(action) and f"storage.root='{s3_store.root}'" in message, message
    assert f"storage.endpoint_url='{proxy.endpoint_url}'" in message and " failed after " in message, message
    assert TIMED_OUT in message, message

    proxy.pass_through()
    call(s3_store, tmp_path)  # works again: nothing half-done is in the way
    assert s3_store.read_bytes("t/x") == b"x" and len(s3_store.versions("model", "m")) == 1 and s3_store.gc() == 0


@pytest.mark.parametrize("size_mib", [12, 20], ids=["single-put", "multipart"])
def test_an_upload_stalled_midway_commits_nothing_and_a_retry_succeeds(size_mib, proxy, s3_store, tmp_path):
    """The server stops reading after 1 MiB: the client's send blocks (aiohttp has no send timeout; this hung
    forever before each attempt had a deadline). 12 MiB goes in one PUT, 20 MiB in 8 MiB parts."""
    files = {"big.bin": bytes(range(256)) * (size_mib * MiB // 256), "small.bin": b"s" * 1000}
    src = make_dir(tmp_path / "ckpt", files)
    proxy.stall_upload(after_bytes=MiB)
    error, waited = timed(lambda: s3_store.put_dir("checkpoint", "c", src))
    if size_mib * MiB < 2 * PART_BYTES:
        bound = stall_bound_s(s3_store.limits, size_mib * MiB)  # 2 x (1 s + 12 MiB / 4 MiB/s) + 1 s = 9 s
    else:  # a part, then s3fs aborts the multipart upload: 2 x (1 + 8 / 4) + 1 + (2 x 1 + 1) = 10 s
        bound = stall_bound_s(s3_store.limits, PART_BYTES) + stall_bound_s(s3_store.limits)
    assert isinstance(error, StoreError) and waited < bound + SLACK_S, (waited, error)
    assert str(error).startswith("upload of checkpoint/c@") and "no version was committed" in str(error)
    assert TIMED_OUT in str(error)

    proxy.pass_through()
    assert s3_store.versions("checkpoint", "c") == []  # no visible partial version
    ref = s3_store.put_dir("checkpoint", "c", src)
    got = s3_store.get_dir(ref)
    assert {rel: (got / rel).read_bytes() for rel in files} == files and s3_store.gc() == 0


def test_sql_on_a_stalled_endpoint_fails_within_the_bound(proxy, s3_store):
    RunTables(s3_store, "run-a").write_metrics(1, {"actor/pg_loss": 0.5})
    bound = stall_bound_s(s3_store.limits)
    con = sql.connect(s3_store)  # lists the files through the store, reads their footers through httpfs
    proxy.stall()
    error, waited = timed(lambda: con.sql("SELECT * FROM metrics").fetchall())  # httpfs reads the file again
    # httpfs: 2 attempts of http_timeout=1 s, 0.1 s apart (DuckDB's backoff, shorter than botocore's)
    assert isinstance(error, duckdb.Error) and waited < bound + SLACK_S, (waited, error)
    error, waited = timed(lambda: sql.query(s3_store, "SELECT count(*) AS n FROM metrics"))  # checks the bucket first
    assert isinstance(error, StoreError) and waited < bound + SLACK_S, (waited, error)
    assert str(error).startswith("reaching the bucket") and TIMED_OUT in str(error)
    proxy.pass_through()
    assert sql.query(s3_store, "SELECT count(*) AS n FROM metrics") == [{"n": 1}]


def test_a_flaky_endpoint_is_absorbed_by_the_retries(proxy, s3_server, tmp_path):
    bucket = s3_server.create_bucket()
    proxy.flaky(every=3)
    for i in range(3):  # a new store each round: new connections, which the proxy drops
        store = open_store(proxy, bucket, tmp_path / f"cache-{i}", max_attempts=3)
        store.check()
        store.write_bytes(f"t/{i}", b"%d" % i)
        assert store.read_bytes(f"t/{i}") == b"%d" % i
        ref = store.put_dir("model", "m", make_dir(tmp_path / f"m{i}", {"w.bin": b"%d" % i * 1000}))
        assert (store.get_dir(ref) / "w.bin").read_bytes() == b"%d" % i * 1000
        assert store.glob("t/*") == [f"t/{j}" for j in range(i + 1)]
        RunTables(store, "run-a").write_metrics(i + 1, {"actor/pg_loss": 0.5})
        assert sql.query(store, "SELECT count(*) AS n FROM metrics") == [{"n": i + 1}]
    assert proxy.dropped >= 3, (proxy.accepted, proxy.dropped)


@pytest.mark.slow
def test_the_default_limits_end_a_hang_within_the_stated_bound(proxy, s3_server, tmp_path):
    store = ArtifactStore(f"s3://{s3_server.create_bucket()}/p", proxy.endpoint_url, tmp_path / "cache")
    assert stall_bound_s(store.limits) == 18  # 3 attempts x 5 s + backoff of at most 1 + 2 s
    proxy.stall()
    error, waited = timed(store.check)
    assert isinstance(error, StoreError) and 15 <= waited < 18 + SLACK_S, (waited, error)


@pytest.mark.slow
def test_a_flow_stalled_mid_rl_ends_failed_within_its_bound(proxy, s3_server, tmp_path, monkeypatch):
    """The incident: RL's first checkpoint upload meets a server that stops reading. The flow must end Failed
    with the store's error, not stay Running."""
    from flows.post_train import post_train
    from infra.checkpoints import StoreCheckpoints
    from tests.integration.test_flow_s3 import TINY_RL

    stalled_at, save = [], StoreCheckpoints.save

    def stall_then_save(self, step, local_dir):
        if not stalled_at:
            proxy.stall_upload(after_bytes=64 * 1024)
            stalled_at.append(time.monotonic())
        return save(self, step, local_dir)

    monkeypatch.setattr(StoreCheckpoints, "save", stall_then_save)
    root = f"s3://{s3_server.create_bucket()}/runs/demo"
    state = post_train(None, [*TINY_OVERRIDES, *TINY_RL, "sft.enabled=false", f"storage.root={root}",
                              f"storage.endpoint_url={proxy.endpoint_url}", f"run.output_dir={tmp_path}",
                              *(f"storage.{key}={value}" for key, value in LIMITS.items())], return_state=True)
    waited = time.monotonic() - stalled_at[0]
    assert state.is_failed()
    with pytest.raises(StoreError, match=f"failed after .*{TIMED_OUT}"):  # the retry's error: its first read
        state.result()
    [run_log] = tmp_path.glob("runs/*/run.log")  # the first attempt's error, not hidden by the lease's release
    assert re.search(f"upload of checkpoint/rl-.* failed after .*{TIMED_OUT}.* - Retry 1/1", run_log.read_text())
    # the upload's request, then Prefect's retry of the RL task, whose first request meets the stall too
    assert waited < 2 * stall_bound_s(StorageConfig(**LIMITS), 16 * MiB) + 30, waited
