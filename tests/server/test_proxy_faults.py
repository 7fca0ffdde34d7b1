"""The proxy under hostile bodies and failing upstreams: 400s for bodies the upstreams could not
take, no prefill without a decode instance, releases of the held pages when the decode leg
fails, an error event for a stream cut by its upstream, health checks that do not flap, and
the proxy's /v1/stats counters. Upstreams are scripted (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from app_harness import Upstreams

from hybridserve.server.proxy import ProxyState, build_proxy

BAD_BODIES = [
    ("nan", b'{"prompt": "a", "temperature": NaN}'),
    ("overflowing float", b'{"prompt": "a", "temperature": 1e400}'),
    ("lone surrogate", b'{"prompt": "\\ud800 alone"}'),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000),
    ("5000-digit integer", b'{"prompt": [' + b"7" * 5000 + b"]}"),
]
BODY = {"prompt": "def ", "max_tokens": 4}


def _state(up: Upstreams, prefill=("p1",), decode=("d1",), **kw) -> ProxyState:
    return ProxyState(
        [f"http://{h}:1" for h in prefill],
        [f"http://{h}:1" for h in decode],
        transport=up.transport(),
        **kw,
    )


async def _send(state: ProxyState, path: str, method: str = "POST", **kw) -> httpx.Response:
    """One request through the proxy app; waits for its background releases."""
    transport = httpx.ASGITransport(build_proxy(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
        reply = await client.request(method, path, **kw)
    await state.settle()
    return reply


def _post(state: ProxyState, body: dict | None = None, **kw) -> httpx.Response:
    if body is not None:
        kw["json"] = body
    return asyncio.run(_send(state, "/v1/completions", **kw))


def _error(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("raw", [b for _, b in BAD_BODIES], ids=[n for n, _ in BAD_BODIES])
def test_bodies_the_upstreams_cannot_take_are_400(raw):
    up = Upstreams()
    _error(_post(_state(up), content=raw), 400)
    assert up.seen == []


def test_no_decode_instance_is_503_before_any_prefill():
    up = Upstreams()
    state = _state(up, decode=("d1", "d2"))
    for inst in state.decode:
        inst.healthy = False
    error = _error(_post(state, BODY), 503)
    assert error["code"] == "no_instance"
    assert up.seen == [] and up.released == []
    assert state.stats.no_instance == 1 and state.stats.prefill_failures == 0


def test_a_finished_decode_releases_nothing():
    up = Upstreams()
    state = _state(up)
    assert _post(state, BODY).json()["choices"][0]["text"] == "decoded by d1"
    streamed = _post(state, {**BODY, "stream": True})
    assert streamed.text.endswith("data: [DONE]\n\n")
    assert up.released == []
    assert state.snapshot()["requests"] == 2 and state.stats.releases_sent == 0


@pytest.mark.parametrize("status", [500, 400])
def test_a_decode_error_answer_releases_the_prefill_pages(status):
    up = Upstreams()
    up.decode_status = status
    state = _state(up)
    reply = _post(state, BODY)
    assert reply.status_code == status and reply.json()["error"]["message"] == "decode"
    assert up.released == [("p1", {"kv_transfer_params": {"from": "p1"}})]
    assert state.stats.releases_sent == 1
    assert state.stats.decode_failures == (1 if status >= 500 else 0)  # a 4xx is the client's


def test_an_unreachable_decode_instance_releases_the_prefill_pages():
    up = Upstreams()
    up.down = {"d1"}
    state = _state(up)
    _error(_post(state, BODY), 503)
    assert [h for h, _, _ in up.seen] == ["p1"]
    assert up.released == [("p1", {"kv_transfer_params": {"from": "p1"}})]
    assert not state.decode[0].healthy  # refused: out at once
    assert state.stats.decode_failures == 1 and state.stats.no_instance == 1


def test_a_stream_cut_by_the_decode_instance_ends_with_an_error_event():
    up = Upstreams()
    up.cut_after = 1
    state = _state(up)
    reply = _post(state, {**BODY, "stream": True})
    assert reply.status_code == 200
    events = [e for e in reply.text.split("\n\n") if e]
    assert events[0] == 'data: {"i": 0}'
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "upstream_error" and "mid-stream" in error["message"]
    assert len(events) == 3
    assert up.released == [("p1", {"kv_transfer_params": {"from": "p1"}})]
    assert state.stats.decode_failures == 1 and state.stats.client_disconnects == 0


def test_a_streamed_decode_error_answer_is_passed_on_and_released():
    up = Upstreams()
    up.decode_status = 503
    state = _state(up)
    reply = _post(state, {**BODY, "stream": True})
    assert reply.status_code == 503 and reply.json()["error"]["message"] == "decode"
    assert len(up.released) == 1 and state.stats.decode_failures == 1


def test_health_checks_need_three_failures_but_a_refusal_is_enough():
    up = Upstreams()
    state = _state(up, prefill=("p1", "p2"), decode=("d1", "d2"))
    d1, d2 = state.decode
    up.health = {"d1": "timeout"}
    for _ in range(2):
        asyncio.run(state.check_health())
    assert d1.healthy and d1.failures == 2  # slow under load: still in rotation
    asyncio.run(state.check_health())
    assert not d1.healthy
    up.health = {}
    asyncio.run(state.check_health())
    assert d1.healthy and d1.failures == 0
    up.health = {"d1": "timeout"}
    asyncio.run(state.check_health())
    up.health = {}
    asyncio.run(state.check_health())
    assert d1.failures == 0  # a success clears the count: failures must be consecutive
    up.down = {"p1"}
    up.health = {"d2": 503}  # draining, or its engine died: it says so
    asyncio.run(state.check_health())
    assert not state.prefill[0].healthy and not d2.healthy
    assert state.prefill[1].healthy and d1.healthy


def test_health_checks_run_concurrently():
    up = Upstreams()
    up.health_delay = 0.2
    state = _state(up, prefill=("p1", "p2"), decode=("d1", "d2"))
    asyncio.run(state.check_health())
    assert up.most_checks_at_once == 4


def test_proxy_stats_count_requests_failures_and_releases():
    up = Upstreams()
    state = _state(up)
    _post(state, BODY)
    up.decode_status = 500
    _post(state, BODY)
    up.decode_status, up.prefill_status = 200, 502
    _post(state, BODY)
    state.decode[0].healthy = False
    _post(state, BODY)

    async def stats() -> httpx.Response:
        transport = httpx.ASGITransport(build_proxy(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await client.get("/v1/stats")

    snapshot = asyncio.run(stats()).json()
    want = dict(requests=4, prefill_failures=1, decode_failures=1, releases_sent=1)
    want.update(release_failures=0, client_disconnects=0, no_instance=1)
    assert {k: snapshot[k] for k in want} == want
    assert snapshot["instances"]["decode"] == {"http://d1:1": {"healthy": False, "failures": 0}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_plain_error_from_the_http_stack_is_a_502_not_a_dropped_connection(stream):
    """httpcore raised AttributeError on a socket whose peer (a prefill or decode instance) was
    just SIGKILLed: the client gets a 502 in the OpenAI shape, and a failed decode leg still
    releases the prefill's pages."""
    for role in ("p1", "d1"):
        up = Upstreams()
        up.broken = {role}
        state = _state(up)
        reply = _post(state, {**BODY, "stream": stream})
        _error(reply, 502)
        assert "AttributeError" in reply.json()["error"]["message"]
        released = [("p1", {"kv_transfer_params": {"from": "p1"}})] if role == "d1" else []
        assert up.released == released


@pytest.mark.parametrize(
    "extra,param", [({"n": 2}, "n"), ({"prompt": ["a", "b"]}, "prompt")], ids=["n", "batch"]
)
def test_several_choices_are_refused_before_any_leg(extra, param):
    """n > 1 and batched prompts do not run disaggregated: a 400 naming the field, no upstream
    call."""
    up = Upstreams()
    error = _error(_post(_state(up), {**BODY, **extra}), 400)
    assert error["param"] == param and up.seen == []


def test_proxy_metrics_count_requests_and_instances():
    """GET /metrics on the proxy: its counters and each instance's rotation state, in the
    Prometheus text format."""
    from prometheus_client.parser import text_string_to_metric_families

    up = Upstreams()
    state = _state(up, decode=("d1", "d2"))
    state.decode[1].healthy = False
    _post(state, BODY)

    reply = asyncio.run(_send(state, "/metrics", "GET"))
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    }
    assert samples[("hybridserve:proxy_requests_total", ())] == 1
    healthy = "hybridserve:proxy_instance_healthy"
    assert samples[(healthy, (("role", "decode"), ("url", "http://d1:1")))] == 1
    assert samples[(healthy, (("role", "decode"), ("url", "http://d2:1")))] == 0
