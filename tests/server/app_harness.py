"""In-process apps for HTTP-level tests: the server's app over a stub engine (nothing loads or
compiles; the engine thread never starts), scripted upstream instances for the proxy, and a
uvicorn server in a thread (the real HTTP layer, for timeouts and disconnects)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import uvicorn
from server_harness import wait_until  # noqa: F401 (the tests import it from here)

from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.server.app import ServerSettings, build_app
from hybridserve.server.async_engine import AsyncEngine
from hybridserve.server.chat import ChatTemplate
from hybridserve.server.listener import HTTPLimits, bind, uvicorn_config


def stub_engine() -> SimpleNamespace:
    """What `AsyncEngine` and `build_app` read of an `LLMEngine`, and nothing more."""
    return SimpleNamespace(
        config=SimpleNamespace(model=str(DEFAULT_MODEL), kv_transfer=None),
        tokenizer=None,
        max_model_len=256,
        model_config=SimpleNamespace(vocab_size=4096),
        stats=lambda: {
            "num_running": 0,
            "num_waiting": 0,
            "num_pages_total": 8,
            "num_pages_used": 0,
        },
        transfers_idle=True,
        close=lambda: None,
    )


def stub_app(**settings: Any) -> tuple[Any, AsyncEngine]:
    """The server's FastAPI app over a stub engine, and its (never started) AsyncEngine."""
    engine = AsyncEngine(stub_engine())  # type: ignore[arg-type]
    return build_app(engine, ServerSettings(**settings), ChatTemplate(None)), engine


async def asgi_post(app: Any, path: str, content: bytes, headers: dict | None = None):
    """POST raw bytes to an ASGI app in process."""
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
        return await client.post(path, content=content, headers=headers)


class Upstreams:
    """Scripted prefill ("p...") and decode ("d...") instances for an httpx.MockTransport.

    Records requests (`seen`), release calls (`released`) and cancelled requests (`cancelled`).
    `down`: hosts that refuse connections; `broken`: hosts whose HTTP stack raises a plain
    error (seen with a peer killed mid-connection); `health`: a host's /health answer (a status, or
    "timeout"); `health_delay`: seconds a /health answer takes (`most_checks_at_once` records
    how many overlapped); `decode_status`: the decode answer's status; `decode_delay`: seconds
    a decode answer takes; `event_delay`: seconds between streamed events; `cut_after`: a
    streamed decode answer fails after this many events; `streams_closed`: streams whose
    reader closed them before their end.
    """

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict]] = []
        self.released: list[tuple[str, dict]] = []
        self.cancelled: list[str] = []
        self.headers: list[tuple[str, str | None]] = []
        self.down: set[str] = set()
        self.broken: set[str] = set()  # hosts whose HTTP stack fails with a plain error
        self.health: dict[str, int | str] = {}
        self.health_delay = 0.0
        self.checks_now = 0
        self.most_checks_at_once = 0
        self.event_delay = 0.0
        self.streams_closed = 0
        self.prefill_status = 200
        self.decode_status = 200
        self.decode_delay = 0.0
        self.cut_after: int | None = None

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def hosts(self) -> list[str]:
        return [h for h, _, _ in self.seen]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        self.headers.append((path, request.headers.get("authorization")))
        if host in self.down:
            raise httpx.ConnectError("refused", request=request)
        if host in self.broken and path != "/health":  # httpcore on a socket its peer closed
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")
        if path == "/health":
            self.checks_now += 1
            self.most_checks_at_once = max(self.most_checks_at_once, self.checks_now)
            try:
                await asyncio.sleep(self.health_delay)
            finally:
                self.checks_now -= 1
            answer = self.health.get(host, 200)
            if answer == "timeout":
                raise httpx.ReadTimeout("slow", request=request)
            return httpx.Response(int(answer), json={})
        body = json.loads(request.content)
        if path == "/v1/kv_transfer/release":
            self.released.append((host, body))
            return httpx.Response(200, json={"released": True})
        self.seen.append((host, path, body))
        if host.startswith("p"):
            if self.prefill_status != 200:
                return httpx.Response(self.prefill_status, json={"error": {"message": "bad"}})
            return httpx.Response(200, json={"kv_transfer_params": {"from": host}})
        try:
            await asyncio.sleep(self.decode_delay)
        except asyncio.CancelledError:
            self.cancelled.append(host)
            raise
        if self.decode_status != 200:
            return httpx.Response(self.decode_status, json={"error": {"message": "decode"}})
        if body.get("stream"):
            return httpx.Response(200, content=self._events())
        return httpx.Response(200, json={"choices": [{"text": f"decoded by {host}"}]})

    async def _events(self):
        done = False
        try:
            for i in range(3):
                if self.cut_after is not None and i == self.cut_after:
                    raise httpx.ReadError("the decode instance went away")
                yield f'data: {{"i": {i}}}\n\n'.encode()
                await asyncio.sleep(self.event_delay)
            yield b"data: [DONE]\n\n"
            done = True
        finally:
            self.streams_closed += not done


@contextlib.contextmanager
def serve_in_thread(app: Any, limits: HTTPLimits) -> Iterator[str]:
    """Run `app` under uvicorn with our listener settings in a thread; yields its base URL."""
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, limits, "warning", graceful_s=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, 30), "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
