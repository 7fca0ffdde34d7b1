"""The FastAPI application: routes, body limits, API key and the OpenAI error shape.

Routes:
  POST /v1/completions        text completion (JSON or server-sent events)
  POST /v1/chat/completions   chat completion (JSON or server-sent events)
  POST /v1/kv_transfer/release  `{"kv_transfer_params": <a prefill response's>}`: a prefill
                              instance frees the pages it holds for that request at once
                              (the proxy sends it when the decode leg failed); answers
                              `{"released": bool}`
  GET  /v1/models             the served model name(s)
  GET  /health                200 while serving; 503 while shutting down or after an engine failure
  GET  /metrics               Prometheus text (see `metrics.py`)
  GET  /v1/stats              the engine's latest statistics as JSON: `engine.stats()` keys
                              (num_running, num_waiting, cache_usage, prefix_cache_*,
                              num_preemptions; transfer_bytes / transfer_failures /
                              held_requests / transfer_gbps on a P/D instance) plus
                              num_pages_used, num_pages_total, queue_depth, max_queue and
                              engine_dead (null, or why the engine loop failed: then the
                              snapshot is the last one, frozen, and the status is 503)

Every error is `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status. The body
(see `body.py`): over `max_body_bytes` 413, not complete within `body_timeout_s` 408, anything
but strict JSON (invalid UTF-8, NaN, 1e400, 5000-digit integers, deep nesting, lone surrogates)
400, and one that does not match the request schema 400 (not FastAPI's 422). With `api_key`
set, every route but /health needs `Authorization: Bearer <api_key>` (401 otherwise, see
`auth.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from hybridserve.server import protocol as P
from hybridserve.server.async_engine import AsyncEngine
from hybridserve.server.auth import BearerAuth
from hybridserve.server.body import read_json
from hybridserve.server.chat import ChatTemplate
from hybridserve.server.errors import APIError, install_error_handlers
from hybridserve.server.metrics import CONTENT_TYPE, CountRequests, ServerMetrics
from hybridserve.server.serving import OpenAIServing, ServingSettings

log = logging.getLogger("hybridserve.server")

ENDPOINTS = {
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/kv_transfer/release",
    "/v1/models",
    "/health",
    "/metrics",
    "/v1/stats",
}


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """Server limits. `request_timeout_s=None`: no per-request timeout; `api_key=None`: no
    authentication; `header_timeout_s` / `body_timeout_s`: see `listener.py` and `body.py`."""

    model_names: tuple[str, ...] = ("default",)
    max_body_bytes: int = 8 << 20
    request_timeout_s: float | None = 600.0
    drain_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    api_key: str | None = dataclasses.field(default=None, repr=False)


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validate a JSON body against a request model, or raise a 400 APIError."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise _validation_error(err.errors()) from err


def _validation_error(errors: list[dict]) -> APIError:
    first = errors[0]
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = "this field is required"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    text = f"{param}: {message}{more}" if param else f"{message}{more}"
    return APIError(400, text, param=param, code=first.get("type"))


def build_app(
    engine: AsyncEngine,
    settings: ServerSettings,
    chat_template: ChatTemplate | None = None,
) -> FastAPI:
    """The application over a not yet started `AsyncEngine` (its lifespan starts the engine
    thread and, on shutdown, drains and stops it)."""
    core = engine.engine
    model_dir = Path(core.config.model)
    metrics = ServerMetrics(engine.stats, lambda: engine.dead is None, settings.model_names[0])
    serving = OpenAIServing(
        engine,
        core.tokenizer,
        chat_template or ChatTemplate.load(model_dir),
        ServingSettings(
            model_names=settings.model_names,
            max_model_len=core.max_model_len,
            vocab_size=core.model_config.vocab_size,
            request_timeout_s=settings.request_timeout_s,
            model_config=core.model_config,
        ),
        metrics,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown(settings.drain_timeout_s)

    app = FastAPI(title="hybridserve", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    if settings.api_key:
        app.add_middleware(BearerAuth, key=settings.api_key)
    # added last, so outermost: it counts the 401s too
    app.add_middleware(CountRequests, metrics=metrics, endpoints=ENDPOINTS)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return _validation_error(list(err.errors())).response()

    install_error_handlers(app, log)

    async def body(request: Request) -> Any:
        return await read_json(request, settings.max_body_bytes, settings.body_timeout_s)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse(P.CompletionRequest, await body(request))
        return await serving.completions(req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse(P.ChatCompletionRequest, await body(request))
        return await serving.chat(req, request)

    @app.post("/v1/kv_transfer/release")
    async def release_kv(request: Request) -> JSONResponse:
        req = parse(P.ReleaseRequest, await body(request))
        if engine.dead is not None:
            raise APIError(503, "the engine died", "service_unavailable", code="engine_error")
        try:
            released = await engine.release_kv(req.kv_transfer_params.model_dump(exclude_none=True))
        except ValueError as err:
            raise APIError(400, str(err), param="kv_transfer_params") from err
        return JSONResponse({"released": bool(released)})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [
            P.ModelCard(id=name, root=str(model_dir), max_model_len=core.max_model_len)
            for name in settings.model_names
        ]
        return JSONResponse(P.ModelList(data=cards).model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.dead is not None:
            return JSONResponse({"status": "engine failed"}, status_code=503)
        if not engine.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/stats")
    async def stats() -> JSONResponse:
        dead = engine.dead
        reason = None if dead is None else f"{type(dead).__name__}: {dead}"
        return JSONResponse(
            {**engine.stats(), "engine_dead": reason}, status_code=200 if dead is None else 503
        )

    return app
