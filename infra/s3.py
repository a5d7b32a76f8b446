"""S3 clients with a bounded wait: an endpoint that accepts connections but never answers makes each request
fail within ``stall_bound_s`` instead of hanging the flow.

Where the time of a request goes (s3fs -> aiobotocore -> aiohttp), measured with ``tests/faults.py``:
- aiohttp has a connect timeout and a read timeout (no byte from the server for that long), but it starts
  the read timeout only once the whole request body is sent, and sending has no timeout at all: a server
  that stops reading an upload blocks ``put_file``/``pipe_file`` forever. So each attempt runs under a
  deadline (``_DeadlineSession``): ``timeout_s`` plus the time to send its body at ``min_upload_mib_s``.
  A response body streamed after that (``get_object``) has the read timeout, so a download that keeps
  receiving is never cut.
- Uploads go in 8 MiB parts (boto3's default) instead of s3fs's 50 MiB: one attempt sends at most 16 MiB
  (a single PUT is used below two parts), which keeps its deadline short.
- botocore retries a failed attempt (connection refused or dropped, timeout, 5xx, throttling) with jittered
  exponential backoff, at most ``2**i`` s before attempt ``i + 2``; it is the only retry layer. Its config key is
  ``total_max_attempts`` (attempts in all); botocore's ``max_attempts`` would count retries, one attempt more.
- s3fs retries on top of that (its ``retries`` loop around each call and again around streamed reads), which
  multiplies the attempts: ``retries = 1`` turns it off.

DuckDB's httpfs (``infra/sql.py``) gets the same timeout per request and number of attempts.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
from typing import TYPE_CHECKING

from aiobotocore.httpsession import AIOHTTPSession
from botocore.exceptions import ReadTimeoutError
from s3fs import S3FileSystem
from s3fs.core import MAX_UPLOAD_PARTS

if TYPE_CHECKING:
    import duckdb

    from infra.config_sections import StorageConfig

PART_BYTES = 8 * 2**20
MAX_BACKOFF_S = 20  # botocore's cap on one backoff (standard retry mode)


class _DeadlineSession(AIOHTTPSession):
    """aiobotocore's aiohttp session with a deadline on each attempt (connect, send the body, get the answer)."""

    def __init__(self, *args, timeout_s: float, upload_bytes_per_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self._timeout_s, self._upload_bytes_per_s = timeout_s, upload_bytes_per_s

    async def send(self, request):
        deadline = self._timeout_s + _body_bytes(request.headers) / self._upload_bytes_per_s
        try:
            return await asyncio.wait_for(super().send(request), deadline)
        except TimeoutError as exc:  # raised as botocore's own timeout, so that botocore retries it
            raise ReadTimeoutError(endpoint_url=request.url, error=f"no answer within {deadline:.1f} s") from exc


def _body_bytes(headers) -> int:
    """Request body size; with a trailing checksum (https) botocore sends it as X-Amz-Decoded-Content-Length."""
    return int(headers.get("X-Amz-Decoded-Content-Length") or headers.get("Content-Length") or 0)


class _S3FileSystem(S3FileSystem):
    """s3fs uploading in PART_BYTES parts (more parts for files over MAX_UPLOAD_PARTS of them)."""

    async def _put_file(self, lpath, rpath, *args, chunksize=None, **kwargs):
        chunksize = chunksize or max(PART_BYTES, math.ceil(os.path.getsize(lpath) / MAX_UPLOAD_PARTS))
        return await super()._put_file(lpath, rpath, *args, chunksize=chunksize, **kwargs)

    async def _pipe_file(self, path, data, chunksize=PART_BYTES, **kwargs):
        return await super()._pipe_file(path, data, chunksize=chunksize, **kwargs)


def s3_filesystem(endpoint_url: str | None, limits: StorageConfig) -> S3FileSystem:
    """An s3fs filesystem whose every request fails within ``stall_bound_s(limits, its body size)``."""
    session = functools.partial(_DeadlineSession, timeout_s=limits.timeout_s,
                                upload_bytes_per_s=limits.min_upload_mib_s * 2**20)
    config = {"connect_timeout": limits.timeout_s, "read_timeout": limits.timeout_s, "http_session_cls": session,
              "retries": {"total_max_attempts": limits.max_attempts, "mode": "standard"}}
    fs = _S3FileSystem(endpoint_url=endpoint_url, skip_instance_cache=True, use_listings_cache=False,
                       config_kwargs=config)
    fs.retries = 1  # one attempt per s3fs call: botocore's retries above are the only ones
    return fs


def stall_bound_s(limits: StorageConfig, body_bytes: int = 0) -> float:
    """The longest one request can wait on an endpoint that never answers: every attempt runs to its deadline,
    with the longest backoff between attempts."""
    attempt = limits.timeout_s + body_bytes / (limits.min_upload_mib_s * 2**20)
    backoff = sum(min(2**i, MAX_BACKOFF_S) for i in range(limits.max_attempts - 1))
    return limits.max_attempts * attempt + backoff


def limit_httpfs(con: duckdb.DuckDBPyConnection, limits: StorageConfig) -> None:
    """The same bound for DuckDB's httpfs: a timeout per request (whole seconds) and max_attempts attempts."""
    con.execute(f"SET http_timeout = {math.ceil(limits.timeout_s)}")
    con.execute(f"SET http_retries = {limits.max_attempts - 1}")
