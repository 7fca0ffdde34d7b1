"""`hybridserve proxy`: one OpenAI endpoint in front of prefill and decode instances (P/D).

Each completion or chat completion goes twice:
  1. to a prefill instance (round-robin), as a non-streaming request with `max_tokens` 1 and
     `kv_transfer_params: {"do_remote_decode": true}`; its reply carries the transfer
     parameters (engine id, side channel, block ids, token count);
  2. to a decode instance (round-robin) with the client's original body plus those
     parameters; the decode instance pulls (or is pushed) the KV pages and Mamba states over
     NIXL and generates; its reply (or server-sent event stream) goes back to the client as is.
An error reply (4xx) of either instance goes back to the client unchanged. An instance that
does not answer (connection refused, timeout) is taken out of rotation and the request is
retried on the next one; a health check (`GET /health` every `health_interval_s`) brings it
back.

Lifecycle:
  1. `ProxyState(prefill_urls, decode_urls)` holds the instances and an httpx client.
  2. `build_proxy(state)` returns the FastAPI app; its lifespan starts the health-check task
     and closes the client at shutdown.
  3. Per request: `_pick` (round-robin over healthy instances), `_prefill`, `_decode`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("hybridserve.proxy")

MAX_BODY = 1 << 20


class NoInstance(RuntimeError):
    """No healthy instance of a role is left."""


class Instance:
    """One upstream server and whether it is in rotation."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.healthy = True

    def __repr__(self) -> str:
        return f"Instance({self.url}, healthy={self.healthy})"


class ProxyState:
    """The prefill and decode instances, round-robin cursors and the shared HTTP client."""

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        timeout_s: float = 600.0,
        health_interval_s: float = 2.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL")
        self.prefill = [Instance(u) for u in prefill]
        self.decode = [Instance(u) for u in decode]
        self._cursor = {"prefill": itertools.count(), "decode": itertools.count()}
        self.health_interval_s = health_interval_s
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=5.0), transport=transport
        )

    def pick(self, role: str) -> list[Instance]:
        """The healthy instances of `role`, starting at the next round-robin position."""
        pool = self.prefill if role == "prefill" else self.decode
        healthy = [i for i in pool if i.healthy]
        if not healthy:
            raise NoInstance(f"no healthy {role} instance")
        start = next(self._cursor[role]) % len(healthy)
        return healthy[start:] + healthy[:start]

    async def check_health(self) -> None:
        """One round of `GET /health` on every instance."""
        for inst in self.prefill + self.decode:
            try:
                reply = await self.client.get(f"{inst.url}/health", timeout=2.0)
                ok = reply.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok != inst.healthy:
                log.warning("%s is %s", inst.url, "back" if ok else "out of rotation")
            inst.healthy = ok


def _error(status: int, message: str, kind: str = "proxy_error") -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


async def _post(state: ProxyState, role: str, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST to the first instance of `role` that answers; dead ones leave the rotation."""
    last: Exception | None = None
    for inst in state.pick(role):
        try:
            return await state.client.post(f"{inst.url}{path}", json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as err:
            inst.healthy = False
            log.warning("%s did not answer (%s): out of rotation", inst.url, err)
            last = err
    raise NoInstance(f"no {role} instance answered: {last}")


async def _stream(state: ProxyState, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """Open a streaming POST on the first decode instance that answers."""
    last: Exception | None = None
    for inst in state.pick("decode"):
        request = state.client.build_request("POST", f"{inst.url}{path}", json=body)
        try:
            return await state.client.send(request, stream=True), inst
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as err:
            inst.healthy = False
            last = err
    raise NoInstance(f"no decode instance answered: {last}")


async def _relay(reply: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in reply.aiter_bytes():
            yield chunk
    finally:
        await reply.aclose()  # a client that went away closes the decode stream: it aborts


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None once it is known to exceed `limit` (never buffered past it)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _handle(state: ProxyState, request: Request, path: str) -> Response:
    raw = await _read_body(request, MAX_BODY)
    if raw is None:
        return _error(413, f"request body over {MAX_BODY} bytes", "invalid_request_error")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return _error(400, f"malformed JSON: {err}", "invalid_request_error")
    if not isinstance(body, dict):
        return _error(400, "the request body must be a JSON object", "invalid_request_error")
    try:
        first = {**body, "stream": False, "max_tokens": 1}
        first.pop("max_completion_tokens", None)
        first.pop("stream_options", None)
        first["kv_transfer_params"] = {"do_remote_decode": True}
        reply = await _post(state, "prefill", path, first)
        if reply.status_code != 200:
            return Response(reply.content, reply.status_code, media_type="application/json")
        params = reply.json().get("kv_transfer_params")
        if not params:
            return _error(502, "the prefill instance returned no kv_transfer_params")
        second = {**body, "kv_transfer_params": params}
        if body.get("stream"):
            upstream, _ = await _stream(state, path, second)
            if upstream.status_code != 200:
                content = await upstream.aread()
                await upstream.aclose()
                return Response(content, upstream.status_code, media_type="application/json")
            return StreamingResponse(_relay(upstream), media_type="text/event-stream")
        reply = await _post(state, "decode", path, second)
        return Response(reply.content, reply.status_code, media_type="application/json")
    except NoInstance as err:
        return _error(503, str(err))
    except httpx.HTTPError as err:
        return _error(502, f"upstream error: {err}")


def build_proxy(state: ProxyState) -> FastAPI:
    """The proxy's FastAPI app (see the module docstring)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def health_loop() -> None:
            while True:
                await state.check_health()
                await asyncio.sleep(state.health_interval_s)

        task = asyncio.create_task(health_loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await state.client.aclose()

    app = FastAPI(title="hybridserve proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(state, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _handle(state, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            for inst in state.pick("decode"):
                with contextlib.suppress(httpx.HTTPError):
                    reply = await state.client.get(f"{inst.url}/v1/models")
                    return Response(reply.content, reply.status_code, media_type="application/json")
        except NoInstance as err:
            return _error(503, str(err))
        return _error(503, "no decode instance answered")

    @app.get("/health")
    async def health() -> Response:
        ok = any(i.healthy for i in state.prefill) and any(i.healthy for i in state.decode)
        status = {
            "prefill": {i.url: i.healthy for i in state.prefill},
            "decode": {i.url: i.healthy for i in state.decode},
        }
        return JSONResponse(status, status_code=200 if ok else 503)

    return app


def run_proxy(
    prefill: list[str],
    decode: list[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    timeout_s: float = 600.0,
    log_level: str = "info",
) -> int:
    """Serve the proxy until SIGTERM/SIGINT; logs `listening on http://HOST:PORT` once bound."""
    import uvicorn

    from hybridserve.server.launch import bind

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    state = ProxyState(prefill, decode, timeout_s=timeout_s)
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    log.info("listening on http://%s:%d", bound_host, bound_port)
    config = uvicorn.Config(build_proxy(state), log_level=log_level, timeout_graceful_shutdown=30)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
