"""A client that leaves the proxy: the upstream request is cancelled (its connection closed)
and the prefill instance is told to release the held pages; with a real server as the decode
instance, that server aborts the request. The proxy runs under uvicorn in a thread."""

from __future__ import annotations

import json

import httpx
import pytest
from app_harness import Upstreams, serve_in_thread, wait_until
from server_harness import counter

from hybridserve.server.listener import HTTPLimits
from hybridserve.server.proxy import ProxyState, build_proxy

BODY = {"prompt": "def ", "max_tokens": 4}
RELEASED = [("p1", {"kv_transfer_params": {"from": "p1"}})]


def _state(transport: httpx.AsyncBaseTransport) -> ProxyState:
    return ProxyState(["http://p1:1"], ["http://d1:1"], transport=transport)


def test_a_json_client_that_leaves_cancels_the_decode_request():
    up = Upstreams()
    up.decode_delay = 60.0
    state = _state(up.transport())
    with serve_in_thread(build_proxy(state), HTTPLimits()) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=BODY, timeout=0.5)
        assert wait_until(lambda: up.released == RELEASED, 10), up.released
        assert up.cancelled == ["d1"]
        assert state.stats.client_disconnects == 1 and state.stats.releases_sent == 1


def test_a_streaming_client_that_leaves_closes_the_decode_stream():
    up = Upstreams()
    up.event_delay = 5.0
    state = _state(up.transport())
    with serve_in_thread(build_proxy(state), HTTPLimits()) as url:
        body = {**BODY, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as reply:
            first = next(line for line in reply.iter_lines() if line)
        assert first == 'data: {"i": 0}'
        assert wait_until(lambda: up.released == RELEASED, 10), up.released
        assert wait_until(lambda: up.streams_closed == 1, 10)
        assert state.stats.client_disconnects == 1 and state.stats.decode_failures == 0


class _DecodeOnServer(httpx.AsyncBaseTransport):
    """Prefill requests go to the scripted upstreams; decode requests go to a real server
    (without the transfer parameters, which a plain server refuses)."""

    def __init__(self, up: Upstreams, server_url: str) -> None:
        self.mock = up.transport()
        self.real = httpx.AsyncHTTPTransport()
        self.server_url = server_url

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "p1":
            return await self.mock.handle_async_request(request)
        content = request.content
        if request.method == "POST":
            body = json.loads(content)
            body.pop("kv_transfer_params", None)
            content = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        forwarded = httpx.Request(
            request.method, self.server_url + request.url.path, content=content, headers=headers
        )
        return await self.real.handle_async_request(forwarded)

    async def aclose(self) -> None:
        await self.real.aclose()


def test_the_decode_server_aborts_when_the_proxys_client_leaves(server):
    up = Upstreams()
    state = _state(_DecodeOnServer(up, server.url))
    before = server.metrics()
    long = {"prompt": "def ", "max_tokens": 240, "ignore_eos": True}
    with serve_in_thread(build_proxy(state), HTTPLimits()) as url:
        with pytest.raises(httpx.ReadTimeout):  # 240 tokens take longer: the client gives up
            httpx.post(url + "/v1/completions", json=long, timeout=0.5)
        assert wait_until(lambda: up.released == RELEASED, 10), up.released
    assert server.idle(timeout=30), server.stats()
    after = server.metrics()
    finished = "hybridserve:request_success_total"
    aborted = counter(after, finished, finished_reason="abort")
    assert aborted - counter(before, finished, finished_reason="abort") == 1
    generated = "hybridserve:generation_tokens_total"
    assert counter(after, generated) - counter(before, generated) < 240
