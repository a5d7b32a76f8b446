"""`RemoteTool`: a tool that lives in a tool server (`python -m stages.tools.server`) on another machine.

In a tools YAML (the schema is the server's; `remote_tools(url)` fetches all of them instead):

    - class_name: stages.tools.remote.RemoteTool
      config: {url: "http://10.0.0.5:8300", timeout_s: 30, max_attempts: 3}
      tool_schema: {type: function, function: {name: python, ...}}

Every request has its own deadline (`timeout_s`). Retries (at most `max_attempts` tries, backoff
`backoff_s` doubling up to `max_backoff_s`) are only those that cannot run a call twice:

- a connection that could not be opened (refused, unreachable: the request never left) or HTTP 503: every
  method retries;
- a timeout or a dropped connection after the request was sent: `create`, `calc_reward` and `release`
  retry (repeating them is harmless: the instance id is chosen here, so a repeated `create` is the same
  instance); `execute` does not, since the tool may have run: it returns an error text at once.

`execute` never raises: when the server cannot be reached after the retries, the text says so and the
metrics carry `error` (and `timeout` for a deadline). `create` and `calc_reward` raise `ToolServerError`
(the loop cannot go on without an instance or a reward), `release` logs a warning.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

from stages.tools.base import BaseTool, ToolResponse, ToolSchema

logger = logging.getLogger(__name__)


class RemoteToolConfig(BaseModel):
    """Where the tool server is and how patiently to talk to it."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(pattern=r"^https?://", description="Base URL of the tool server, e.g. http://host:8300.")
    timeout_s: float = Field(default=30.0, gt=0, description="Deadline of one HTTP request (and so one call, "
                             "time in the server's queue included; the loop's tool_timeout_s applies when longer).")
    max_attempts: int = Field(default=3, ge=1, le=20, description="Tries per request, retries included.")
    backoff_s: float = Field(default=0.2, ge=0, description="Wait before the first retry; doubles each time.")
    max_backoff_s: float = Field(default=2.0, ge=0, description="Longest wait between two tries.")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try number `attempt` (1-based)."""
        return min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)


class ToolServerError(RuntimeError):
    """The tool server could not be reached or refused a request."""


class _SentButFailed(Exception):
    """A request that may have reached the server: a timeout or a connection lost mid-way."""

    def __init__(self, cause: BaseException, timeout: bool):
        super().__init__(f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__)
        self.timeout = timeout


class RemoteTool(BaseTool):
    """A tool served by `stages.tools.server`; its schema must be given (YAML) or fetched (`remote_tools`)."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: ToolSchema | dict | None = None):
        super().__init__(config, tool_schema)
        self.remote = RemoteToolConfig.model_validate(self.config)
        # the request's own deadline (then an error text with the timeout metric) and the retries of connections
        # that never opened: the loop's tool_timeout_s must not cut a call waiting in the server's queue sooner
        self.own_timeout_s = self.remote.timeout_s + (self.remote.max_attempts - 1) * self.remote.max_backoff_s

    @classmethod
    def default_schema(cls) -> ToolSchema:
        raise ValueError("RemoteTool needs `tool_schema` (the server's), or use stages.tools.remote.remote_tools(url)")

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        instance_id = instance_id or uuid.uuid4().hex  # chosen here, so that a retried create is idempotent
        body = await self._request("create", {"instance_id": instance_id, "create_kwargs": create_kwargs}, True)
        return str(body["instance_id"])

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolResponse:
        try:
            body = await self._request("execute", {"instance_id": instance_id, "parameters": parameters}, False)
        except _SentButFailed as exc:
            what = "timed out" if exc.timeout else "failed"
            text = f"error: remote tool {self.name!r} {what} ({exc}); it may or may not have run"
            return ToolResponse(text, metrics={"error": 1.0, "timeout": float(exc.timeout)})
        except ToolServerError as exc:
            return ToolResponse(f"error: remote tool {self.name!r}: {exc}", metrics={"error": 1.0, "timeout": 0.0})
        return ToolResponse(str(body["text"]), float(body.get("reward", 0.0)), dict(body.get("metrics", {})))

    async def calc_reward(self, instance_id: str) -> float:
        body = await self._request("calc_reward", {"instance_id": instance_id}, True)
        return float(body["reward"])

    async def release(self, instance_id: str) -> None:
        try:
            await self._request("release", {"instance_id": instance_id}, True)
        except ToolServerError as exc:
            logger.warning("remote tool %r: release of %s failed: %s", self.name, instance_id, exc)

    async def _request(self, method: str, payload: dict[str, Any], repeatable: bool) -> dict[str, Any]:
        """POST with retries (see the module docstring); raises ToolServerError, or _SentButFailed when
        `repeatable` is False and the request may have reached the server."""
        url = f"{self.remote.url.rstrip('/')}/tools/{self.name}/{method}"
        last: BaseException | None = None
        for attempt in range(1, self.remote.max_attempts + 1):
            try:
                return await self._post_once(url, payload)
            except (aiohttp.ClientConnectorError, _Unavailable) as exc:
                last = exc  # never reached the tool: safe to repeat for every method
            except (TimeoutError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    aiohttp.ClientPayloadError) as exc:
                if not repeatable:
                    raise _SentButFailed(exc, timeout=isinstance(exc, TimeoutError)) from exc
                last = exc
            if attempt < self.remote.max_attempts:
                await asyncio.sleep(self.remote.delay(attempt))
        raise ToolServerError(f"tool server {self.remote.url} did not answer {method} after "
                              f"{self.remote.max_attempts} attempts (last: {type(last).__name__}: {last})")

    async def _post_once(self, url: str, payload: dict[str, Any]) -> dict[str, Any]:
        # A session per request: sessions belong to one event loop, and a tool object may outlive loops.
        timeout = aiohttp.ClientTimeout(total=self.remote.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.post(url, json=payload) as response:
            text = await response.text()
            if response.status == 503:
                raise _Unavailable(f"HTTP 503: {text[:200]}")
            try:
                body = json.loads(text)
            except ValueError:
                raise ToolServerError(f"{url} answered HTTP {response.status} with non-JSON {text[:200]!r}") from None
            if response.status != 200:
                raise ToolServerError(f"{url} answered HTTP {response.status}: {body.get('error', body)}")
            return body


class _Unavailable(Exception):
    """HTTP 503: the server (or a proxy) refused before running anything."""


def remote_tools(url: str, **config: Any) -> dict[str, RemoteTool]:
    """Every tool of the server at `url`, as RemoteTools (blocking: call it at setup, not in the loop).

    Args:
        url: Base URL of the tool server.
        **config: Other `RemoteToolConfig` fields (timeout_s, max_attempts, backoff_s, max_backoff_s).

    Raises:
        ToolServerError: The server did not answer `GET /tools` within the attempts.
    """
    settings = RemoteToolConfig(url=url, **config)
    listing = f"{url.rstrip('/')}/tools"
    for attempt in range(1, settings.max_attempts + 1):
        try:
            with urllib.request.urlopen(listing, timeout=settings.timeout_s) as response:
                schemas = json.loads(response.read())["tools"]
            break
        except urllib.error.HTTPError as exc:
            if exc.code != 503:
                raise ToolServerError(f"tool server {url} answered GET /tools with HTTP {exc.code}: "
                                      f"{exc.read()[:200]!r}; is {url} a `stages.tools.server`?") from None
            if attempt == settings.max_attempts:
                raise ToolServerError(f"tool server {url} unavailable (HTTP 503) after {attempt} attempts") from None
            time.sleep(settings.delay(attempt))
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            if attempt == settings.max_attempts:
                raise ToolServerError(f"tool server {url} did not answer GET /tools after {attempt} attempts "
                                      f"({exc}); is `python -m stages.tools.server` running there?") from None
            time.sleep(settings.delay(attempt))
    tool_config = settings.model_dump()
    return {schema["function"]["name"]: RemoteTool(tool_config, schema) for schema in schemas}
