"""The server's app in process over a stub engine (nothing compiles): the release route, the
statistics of a dead engine, a body that never finishes, the strict JSON checks, and the
error event that ends a stream whose engine died."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from app_harness import asgi_post, stub_app

from hybridserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from hybridserve.server import protocol as P
from hybridserve.server.async_engine import EngineDead
from hybridserve.server.chat import ChatTemplate
from hybridserve.server.formatting import ResponseFormat
from hybridserve.server.metrics import RequestTrack, ServerMetrics
from hybridserve.server.serving import OpenAIServing, ServingSettings

RELEASE = "/v1/kv_transfer/release"
PARAMS = {"engine_id": "e1", "req_id": "r1", "block_tables": [[3, 4]], "num_tokens": 9}


@pytest.fixture(scope="module")
def app_and_engine():
    return stub_app(body_timeout_s=0.3)


def _get(app, path: str) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await client.get(path)

    return asyncio.run(go())


def test_release_route_passes_the_params_to_the_engine(app_and_engine, monkeypatch):
    app, engine = app_and_engine
    calls = []

    async def release_kv(params: dict) -> bool:
        calls.append(params)
        return True

    monkeypatch.setattr(engine, "release_kv", release_kv, raising=False)
    body = b'{"kv_transfer_params": {"engine_id": "e1", "req_id": "r1", '
    body += b'"block_tables": [[3, 4]], "num_tokens": 9}}'
    reply = asyncio.run(asgi_post(app, RELEASE, body))
    assert reply.status_code == 200 and reply.json() == {"released": True}
    assert calls == [PARAMS]


@pytest.mark.parametrize(
    "body",
    [
        b"{",
        b"[]",
        b"{}",
        b'{"kv_transfer_params": 5}',
        b'{"kv_transfer_params": {"port": "x"}}',
        b'{"kv_transfer_params": {}, "extra": 1}',
        b'{"kv_transfer_params": {"req_id": "\\ud800"}}',
    ],
)
def test_a_malformed_release_is_400(app_and_engine, monkeypatch, body):
    app, engine = app_and_engine

    async def release_kv(params: dict) -> bool:
        raise AssertionError("a malformed release reached the engine")

    monkeypatch.setattr(engine, "release_kv", release_kv, raising=False)
    reply = asyncio.run(asgi_post(app, RELEASE, body))
    assert reply.status_code == 400, reply.text
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_stats_of_a_dead_engine_are_503_with_the_reason(app_and_engine, monkeypatch):
    app, engine = app_and_engine
    alive = _get(app, "/v1/stats")
    assert alive.status_code == 200 and alive.json()["engine_dead"] is None
    monkeypatch.setattr(engine, "dead", RuntimeError("the device fell off"))
    dead = _get(app, "/v1/stats")
    assert dead.status_code == 503
    stats = dead.json()
    assert stats["engine_dead"] == "RuntimeError: the device fell off"
    assert stats["num_running"] == 0 and "num_pages_total" in stats  # the last snapshot
    assert _get(app, "/health").status_code == 503


def test_a_body_that_never_ends_gets_408(app_and_engine):
    app, _ = app_and_engine
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": b'{"prompt": ', "more_body": True}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await asyncio.sleep(3600)  # the rest of the body never comes
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-type", b"application/json")],
        "query_string": b"",
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 408
    assert (b"connection", b"close") in start["headers"]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "a", "temperature": NaN}',
        b'{"prompt": "a", "temperature": 1e400}',
        b'{"prompt": "\\udc00"}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"prompt": [' + b"1" * 5000 + b"]}",
    ],
    ids=["nan", "1e400", "lone surrogate", "deep nesting", "5000 digits"],
)
def test_bodies_json_loads_takes_but_utf8_cannot_are_400(app_and_engine, raw):
    app, _ = app_and_engine
    reply = asyncio.run(asgi_post(app, "/v1/completions", raw))
    assert reply.status_code == 400, reply.text


class _DyingStream:
    """A request stream whose engine dies after one output."""

    def __init__(self) -> None:
        self.closed = False
        self._left = [self._output()]

    @staticmethod
    def _output() -> RequestOutput:
        out = CompletionOutput(index=0, text="Hi", token_ids=[7])
        return RequestOutput("r", None, [1], [out], False, RequestMetrics(0.0), [7])

    def __aiter__(self) -> _DyingStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._left:
            return self._left.pop()
        raise EngineDead("the engine failed: RuntimeError: boom")

    def close(self) -> None:
        self.closed = True


def test_an_engine_that_dies_mid_stream_ends_it_with_an_error_event():
    metrics = ServerMetrics(dict, lambda: False)
    settings = ServingSettings(model_names=("m",), max_model_len=256, vocab_size=4096)
    serving = OpenAIServing(None, None, ChatTemplate(None), settings, metrics)  # type: ignore[arg-type]
    req = P.CompletionRequest(prompt=[1], stream=True)
    fmt = ResponseFormat(req, "cmpl-1", "m", None, [1])
    stream = _DyingStream()

    async def collect() -> list[str]:
        track = RequestTrack(metrics, "cmpl-1", 0.0)
        return [e async for e in serving._events(stream, track, fmt)]  # type: ignore[arg-type]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    assert '"text":"Hi"' in events[0]  # what was generated before went out
    error = P.ErrorResponse.model_validate_json(events[-2].removeprefix("data: "))
    assert error.error.code == "engine_error" and "boom" in error.error.message
    assert stream.closed
