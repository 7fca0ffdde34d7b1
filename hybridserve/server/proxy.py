"""`hybridserve proxy`: one OpenAI endpoint in front of prefill and decode instances (P/D).

Each completion or chat completion goes twice (see `proxy_routes.py` for the whole lifecycle):
  1. to a prefill instance (round-robin), as a non-streaming request with `max_tokens` 1 and
     `kv_transfer_params: {"do_remote_decode": true}`; its reply carries the transfer
     parameters (engine id, side channel, block ids, token count);
  2. to a decode instance (round-robin) with the client's original body plus those
     parameters; the decode instance pulls (or is pushed) the KV pages and Mamba states over
     NIXL and generates; its reply (or server-sent event stream) goes back to the client.
An error reply of either instance goes back to the client unchanged. A request is refused
(503) before its prefill when no decode instance is in rotation; when the decode leg fails or
the client leaves, the prefill instance is told to free the held pages at once. Instances leave
and rejoin the rotation as `proxy_state.py` describes (health checks every
`health_interval_s`, several failures in a row before a slow instance leaves).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (a decode instance's),
GET /health (200 while some prefill and some decode instance are in rotation), GET /metrics
(Prometheus: the counters below and each instance's rotation state), GET /v1/stats
(the proxy's counters: requests, prefill_failures, decode_failures, client_disconnects,
releases_sent, release_failures, no_instance, and each instance's state). With an API key,
every route but /health needs `Authorization: Bearer KEY` (`auth.py`); the upstream key goes
to the instances.

Lifecycle:
  1. `ProxyState(prefill_urls, decode_urls, ...)` holds the instances and an httpx client.
  2. `build_proxy(state, api_key)` returns the FastAPI app; its lifespan starts the health-check
     task and, at shutdown, stops it, waits briefly for releases in flight and closes the client.
  3. Per request: `proxy_routes.handle`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hybridserve.server.auth import BearerAuth
from hybridserve.server.errors import APIError, install_error_handlers
from hybridserve.server.listener import HTTPLimits, bind, uvicorn_config
from hybridserve.server.metrics import CONTENT_TYPE, proxy_metrics
from hybridserve.server.proxy_routes import handle
from hybridserve.server.proxy_state import Instance, NoInstance, ProxyState, ProxyStats

__all__ = ["Instance", "NoInstance", "ProxyState", "ProxyStats", "build_proxy", "run_proxy"]

log = logging.getLogger("hybridserve.proxy")


def build_proxy(state: ProxyState, api_key: str | None = None) -> FastAPI:
    """The proxy's FastAPI app (see the module docstring); `api_key`: the key clients send."""

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
        await state.settle(timeout=5.0)
        await state.client.aclose()

    app = FastAPI(title="hybridserve proxy", lifespan=lifespan)
    if api_key:
        app.add_middleware(BearerAuth, key=api_key)

    install_error_handlers(app, log)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(state, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(state, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            for inst in state.pick("decode"):
                with contextlib.suppress(httpx.HTTPError):
                    reply = await state.client.get(f"{inst.url}/v1/models")
                    return Response(reply.content, reply.status_code, media_type="application/json")
        except NoInstance as err:
            return APIError(503, str(err), "service_unavailable", code="no_instance").response()
        return APIError(503, "no decode instance answered", "service_unavailable").response()

    @app.get("/health")
    async def health() -> Response:
        ok = any(i.healthy for i in state.prefill) and any(i.healthy for i in state.decode)
        status = {
            "prefill": {i.url: i.healthy for i in state.prefill},
            "decode": {i.url: i.healthy for i in state.decode},
        }
        return JSONResponse(status, status_code=200 if ok else 503)

    @app.get("/v1/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(state.snapshot())

    @app.get("/metrics")
    async def metrics() -> Response:
        health = {
            "prefill": {i.url: i.healthy for i in state.prefill},
            "decode": {i.url: i.healthy for i in state.decode},
        }
        body = proxy_metrics(dataclasses.asdict(state.stats), health)
        return Response(body, media_type=CONTENT_TYPE)

    return app


def proxy_state(
    prefill: list[str],
    decode: list[str],
    timeout_s: float,
    api_key: str | None,
    upstream_api_key: str | None,
    limits: HTTPLimits,
    max_body_bytes: int,
) -> ProxyState:
    """The state `run_proxy` serves: the upstream key defaults to the proxy's own."""
    return ProxyState(
        prefill,
        decode,
        timeout_s=timeout_s,
        upstream_api_key=upstream_api_key or api_key,
        max_body_bytes=max_body_bytes,
        body_timeout_s=limits.body_timeout_s,
    )


def run_proxy(
    prefill: list[str],
    decode: list[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    timeout_s: float = 600.0,
    log_level: str = "info",
    api_key: str | None = None,
    upstream_api_key: str | None = None,
    limits: HTTPLimits | None = None,
    max_body_bytes: int = 8 << 20,
) -> int:
    """Serve the proxy until SIGTERM/SIGINT; logs `listening on http://HOST:PORT` once bound.
    `upstream_api_key` defaults to `api_key`."""
    import uvicorn

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if log_level.lower() != "debug":  # httpx logs every upstream call (health checks too)
        logging.getLogger("httpx").setLevel(logging.WARNING)
    limits = limits or HTTPLimits()
    state = proxy_state(
        prefill, decode, timeout_s, api_key, upstream_api_key, limits, max_body_bytes
    )
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    log.info("listening on http://%s:%d%s", bound_host, bound_port, " (API key)" if api_key else "")
    config = uvicorn_config(build_proxy(state, api_key), limits, log_level, graceful_s=30)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
