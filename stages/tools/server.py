"""Serve tools over HTTP, so that they can run on other machines than the rollout (`RemoteTool` is the client):

    python -m stages.tools.server --tools tools.yaml --host 127.0.0.1 --port 8300 [--call-timeout-s 60]

    GET  /health                      {"status": "ok", "num_tools": N}
    GET  /tools                       {"tools": [OpenAI schema, ...]}
    POST /tools/{name}/create         {"instance_id"?, "create_kwargs"?}  -> {"instance_id"}
    POST /tools/{name}/execute        {"instance_id", "parameters"}       -> {"text", "reward", "metrics"}
    POST /tools/{name}/calc_reward    {"instance_id"}                     -> {"reward"}
    POST /tools/{name}/release        {"instance_id"}                     -> {}

`execute` goes through `run_tool_call`, so bad arguments, a raising tool and one running past
`--call-timeout-s` are HTTP 200 with an error text and the `error`/`timeout` metrics, exactly as in-process.
A request the server cannot serve is a JSON error: 400 (malformed body), 404 (unknown tool or method), 500
(create/calc_reward/release raised). With `--port 0` the OS picks a free port; the line `serving N tools on
http://HOST:PORT` on stdout gives it (printed once the socket listens). SIGTERM or SIGINT stop it cleanly.
Nothing authenticates requests: bind to 127.0.0.1 or a private network only.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from stages.tools.base import BaseTool, ToolCall
from stages.tools.calls import run_tool_call
from stages.tools.registry import load_tools

logger = logging.getLogger(__name__)

METHODS = ("create", "execute", "calc_reward", "release")
TOOLS_KEY = web.AppKey("tools", dict)
TIMEOUT_KEY = web.AppKey("call_timeout_s", float)


class BadRequest(ValueError):
    """A request body the server refuses (HTTP 400)."""


def build_app(tools: dict[str, BaseTool], call_timeout_s: float) -> web.Application:
    """The aiohttp application serving `tools`; `call_timeout_s` bounds each `execute`."""
    app = web.Application(middlewares=[_json_errors])
    app[TOOLS_KEY] = tools
    app[TIMEOUT_KEY] = call_timeout_s
    app.add_routes([
        web.get("/health", _health),
        web.get("/tools", _list_tools),
        web.post("/tools/{name}/{method}", _call),
    ])
    return app


@web.middleware
async def _json_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Every failure as `{"error": ...}` JSON, so the client can show it; the server keeps serving."""
    try:
        return await handler(request)
    except BadRequest as exc:
        return web.json_response({"error": str(exc)}, status=400)
    except web.HTTPException as exc:
        return web.json_response({"error": exc.text or exc.reason}, status=exc.status)
    except Exception as exc:  # a tool's create/calc_reward/release raised: report, keep serving
        logger.exception("tool server: %s %s failed", request.method, request.path)
        return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "num_tools": len(request.app[TOOLS_KEY])})


async def _list_tools(request: web.Request) -> web.Response:
    return web.json_response({"tools": [tool.schema.to_openai() for tool in request.app[TOOLS_KEY].values()]})


async def _call(request: web.Request) -> web.Response:
    tools: dict[str, BaseTool] = request.app[TOOLS_KEY]
    name, method = request.match_info["name"], request.match_info["method"]
    if name not in tools:
        raise web.HTTPNotFound(text=f"unknown tool {name!r}; this server has: {', '.join(sorted(tools))}")
    if method not in METHODS:
        raise web.HTTPNotFound(text=f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    body = await _body(request)
    tool = tools[name]
    if method == "create":
        create_kwargs = _field(body, "create_kwargs", dict, default={})
        instance_id = await tool.create(_field(body, "instance_id", str, default=None), **create_kwargs)
        return web.json_response({"instance_id": instance_id})
    instance_id = _field(body, "instance_id", str)
    if method == "execute":
        call = ToolCall(name, _field(body, "parameters", dict))
        response = await run_tool_call(tool, instance_id, call, request.app[TIMEOUT_KEY])
        return web.json_response({"text": response.text, "reward": response.reward, "metrics": response.metrics})
    if method == "calc_reward":
        return web.json_response({"reward": float(await tool.calc_reward(instance_id))})
    await tool.release(instance_id)
    return web.json_response({})


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise BadRequest(f"request body is not JSON ({exc}); send a JSON object") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


_REQUIRED = object()


def _field(body: dict[str, Any], key: str, kind: type, default: Any = _REQUIRED) -> Any:
    if key not in body or body[key] is None:
        if default is _REQUIRED:
            raise BadRequest(f"request body needs {key!r} ({kind.__name__})")
        return default
    if not isinstance(body[key], kind):
        raise BadRequest(f"{key!r} must be {kind.__name__}, got {type(body[key]).__name__}")
    return body[key]


async def serve(tools: dict[str, BaseTool], host: str, port: int, call_timeout_s: float) -> None:
    """Serve until SIGTERM/SIGINT; prints the bound address (the real port when `port` is 0)."""
    runner = web.AppRunner(build_app(tools, call_timeout_s), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    print(f"serving {len(tools)} tools on http://{bound_host}:{bound_port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve tools from a tools YAML over HTTP.")
    parser.add_argument("--tools", required=True, help="tools YAML (verl format: a `tools:` list)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8300, help="port (0: any free port, printed)")
    parser.add_argument("--call-timeout-s", type=float, default=60.0, help="wall-clock limit of one execute")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        tools = load_tools(args.tools)
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")
    asyncio.run(serve(tools, args.host, args.port, args.call_timeout_s))


if __name__ == "__main__":
    main()
